"""RLHF on generated text: a language model learns to continue neutral prompts positively (trlX's sentiment task).

    llmrl run --config configs/rlhf-sentiment.yaml examples/rlhf_sentiment.py        # SmolLM2-135M, ppo_tokens
    llmrl run --config configs/rlhf-sentiment-grpo.yaml examples/rlhf_sentiment.py   # the same with grpo
    llmrl run --config configs/rlhf-sentiment-nlpo.yaml examples/rlhf_sentiment.py --steer   # nlpo, masked sampling
    llmrl run --config configs/rlhf-sentiment-quick.yaml examples/rlhf_sentiment.py --quick   # tiny model, CI

The script is the client of an llmrl run. Each update it samples ``samples_per_prompt`` continuations of
``prompts_per_update`` training prompts with ``generate`` (which returns each token's log-prob under the policy
that sampled it), scores them with the reward (VADER's compound sentiment of the continuation, in [-1, 1], minus
``short_penalty`` for a continuation of fewer than 3 words and ``repeat_penalty`` x the share of its word
trigrams that repeat an earlier one: "I love it. I love it. I love it." is positive but not what we want), and
calls ``update`` with the prompts, the
continuations' token ids, the rewards and the old log-probs. The config's updater does the rest on the servers:
``ppo_tokens`` (KL penalty to the starting model, a per-token value head, GAE, clipped PPO) or ``grpo``
(group-relative advantages, no critic) or ``nlpo`` (``ppo_tokens`` within a masking policy's top-p set; with
``--steer`` the script samples, and evaluates, with the updater's own policy: ``generate(..., steer=True)``); the
script does not change otherwise. Before and after training it generates greedy continuations of the held-out
prompts and reports their mean reward with a 95% confidence interval.

Writes, in ``--out``: ``curve.png`` (training reward and KL to the starting model per update, and the held-out
reward before and after), ``metrics.csv`` (one row per update), ``summary.json`` (evaluations, confidence
intervals, KL, timings, sample continuations before and after).

The prompts are built here from word lists (no download); prompts made from the held-out subjects are never
trained on.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Annotated

from dataclass_flags import flags_parser  # the examples' folder: on the path as the script's own
from demo_outputs import reward_curve, write_metrics

from llmrl import Caller
from llmrl.engine.output_folder import claim_output_folder
from llmrl.engine.provenance import run_provenance

SUBJECTS = ["movie", "weather", "new phone", "restaurant", "train ride", "book", "meeting", "concert", "hotel",
            "neighbourhood", "football game", "lecture", "coffee", "museum", "flight", "apartment", "garden",
            "interview", "party", "bus", "song", "trip", "class", "dinner"]
HELD_OUT_SUBJECTS = ["play", "beach", "market", "holiday", "office", "road"]
FRAMES = ["The {s} was", "I think the {s} is", "Yesterday the {s}", "My friend said that the {s}",
          "Everyone was talking about the {s}, and", "To be honest, the {s}", "When I got to the {s}, it",
          "This morning the {s}", "Last week we went to the {s}. It", "The {s} we had last night",
          "My opinion of the {s} is that it", "In my view, the {s}"]


def build_prompts() -> tuple[list[str], list[str]]:
    """Training prompts (the 24 training subjects in 12 frames: 288) and held-out ones (6 other subjects: 72)."""
    train = [frame.format(s=s) for s in SUBJECTS for frame in FRAMES]
    held_out = [frame.format(s=s) for s in HELD_OUT_SUBJECTS for frame in FRAMES]
    return train, held_out


@dataclass
class Args:
    updates: Annotated[int, "PPO / GRPO updates"] = 30
    prompts_per_update: Annotated[int, "training prompts per update"] = 8
    samples_per_prompt: Annotated[int, "continuations sampled per prompt (GRPO's group size)"] = 4
    max_new_tokens: Annotated[int, "continuation length"] = 16
    short_penalty: Annotated[float, "subtracted from the reward of a continuation with fewer than 3 words"] = 0.5
    repeat_penalty: Annotated[float, "times the share of repeated word trigrams, subtracted from the reward"] = 1.0
    eval_prompts: Annotated[int, "held-out prompts in each evaluation (at most 72)"] = 72
    seed: Annotated[int, "seed of the prompt order, the sampling and the model's new weights"] = 0
    out: Annotated[str, "where the curve, metrics and summary go"] = "runs/rlhf_sentiment"
    steer: Annotated[bool, "sample and evaluate with the updater's own policy (nlpo: the masked one)"] = False
    quick: Annotated[bool, "a tiny smoke run (CI): 2 updates, 4 prompts, 8 evaluation prompts"] = False


def parse_args() -> Args:
    parser = flags_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args.updates, args.prompts_per_update, args.samples_per_prompt, args.eval_prompts = 2, 4, 2, 8
        args.max_new_tokens = 8
    return args


def repetition(text: str) -> float:
    """The share of the text's word trigrams that repeat an earlier one (0: none repeats)."""
    words = ["".join(c for c in w.lower() if c.isalnum()) for w in text.split()]
    trigrams = [tuple(words[k:k + 3]) for k in range(len(words) - 2)]
    return 1.0 - len(set(trigrams)) / len(trigrams) if trigrams else 0.0


class Reward:
    """VADER's compound sentiment score of a continuation (a lexicon scorer that runs offline), minus the penalties
    for a too-short or repetitive continuation."""

    def __init__(self, short_penalty: float, repeat_penalty: float):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()
        self.short_penalty, self.repeat_penalty = short_penalty, repeat_penalty

    def sentiment(self, text: str) -> float:
        return self.analyzer.polarity_scores(text)["compound"]

    def __call__(self, text: str) -> float:
        words = [w for w in text.split() if any(c.isalpha() for c in w)]
        penalty = self.short_penalty if len(words) < 3 else 0.0
        return self.sentiment(text) - penalty - self.repeat_penalty * repetition(text)


def mean_ci(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and its 95% confidence interval (normal approximation)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(n - 1, 1))
    half = z * std / math.sqrt(n)
    return mean, mean - half, mean + half


def evaluate(caller: Caller, prompts: list[str], reward: Reward, args: Args, label: str) -> dict:
    """Greedy continuations of the held-out prompts and their mean reward."""
    samples = caller.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=False,
                              **({"steer": True} if getattr(args, "steer", False) else {}))  # shared: other Args
    texts = [group[0]["text"] for group in samples]
    rewards = [reward(t) for t in texts]
    mean, low, high = mean_ci(rewards)
    words = [len(t.split()) for t in texts]
    sentiment = sum(reward.sentiment(t) for t in texts) / len(texts)
    repeated = sum(repetition(t) for t in texts) / len(texts)
    print(f"{label}: held-out reward {mean:+.3f} (95% CI {low:+.3f} to {high:+.3f}) over {len(prompts)} prompts; "
          f"sentiment {sentiment:+.3f}, repeated trigrams {repeated:.1%}, {sum(words) / len(words):.1f} words per "
          "continuation", flush=True)
    return {"label": label, "prompts": len(prompts), "mean_reward": mean, "ci95": [low, high],
            "mean_sentiment": sentiment, "repeated_trigrams": repeated, "mean_words": sum(words) / len(words),
            "continuations": texts, "rewards": rewards}


def train(caller: Caller, prompts: list[str], reward: Reward, args: Args) -> list[dict]:
    from tqdm import tqdm

    order = random.Random(args.seed)
    pool: list[str] = []
    history = []
    bar = tqdm(range(args.updates), desc="RLHF", unit="update")
    for update in bar:
        start = time.time()
        if len(pool) < args.prompts_per_update:
            pool += order.sample(prompts, len(prompts))
        batch, pool = pool[: args.prompts_per_update], pool[args.prompts_per_update:]
        samples = caller.generate(batch, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                                  temperature=1.0, num_return_sequences=args.samples_per_prompt,
                                  seed=args.seed * 100003 + update, **({"steer": True} if args.steer else {}))
        rewards = [[reward(s["text"]) for s in group] for group in samples]
        generate_seconds = time.time() - start
        # the sampler's log-probs, unless it sampled a steered policy (nlpo computes the masked policy's itself)
        old = {} if args.steer else {"old_logprobs": [[s["logprobs"] for s in group] for group in samples]}
        stats = caller.update(batch, [[s["tokens"] for s in group] for group in samples], rewards=rewards, **old)
        flat = [r for group in rewards for r in group]
        row = {"update": update + 1, "samples": len(flat), "reward": sum(flat) / len(flat),
               "generate_seconds": generate_seconds, "update_seconds": time.time() - start - generate_seconds,
               "mean_tokens": sum(len(s["tokens"]) for g in samples for s in g) / len(flat)}
        n = sum(s["samples"] for s in stats)
        for key in ("kl", "kl_coef", "policy_loss", "value_loss", "value_error", "entropy", "approx_kl",
                    "clip_fraction", "mask_size", "mask_misses"):
            if all(key in s for s in stats):
                row[key] = sum(s[key] * s["samples"] for s in stats) / max(n, 1)
        history.append(row)
        caller.log({f"train/{key}": row[key] for key in ("reward", "mean_tokens", "generate_seconds")})
        bar.set_postfix(reward=f"{row['reward']:+.2f}", kl=f"{row.get('kl', 0.0):.2f}")
    return history


def plot(history: list[dict], before: dict, after: dict, path: str, title: str) -> None:
    reward_curve(history, before, after, path, title=title, reward_label="reward (VADER compound - penalties)",
                 kl_label="KL to the starting model", kl_unit="continuation")


def matmul_gflops(threads: int = 2, size: int = 1536) -> float:
    """This machine's float32 matrix-multiply rate (best of 5), to put the wall time in context."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def main() -> None:
    args = parse_args()
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    train_prompts, held_out = build_prompts()
    held_out = held_out[: args.eval_prompts]
    reward = Reward(args.short_penalty, args.repeat_penalty)
    start = time.time()
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        print(f"llmrl: {caller.info}", flush=True)
        before = evaluate(caller, held_out, reward, args, "before training")
        caller.log({"eval/mean_reward": before["mean_reward"]})  # step 0: before any update
        history = train(caller, train_prompts, reward, args)
        after = evaluate(caller, held_out, reward, args, "after training")
        caller.log({"eval/mean_reward": after["mean_reward"]})  # at the last update's step
    wall = time.time() - start
    gflops = matmul_gflops()
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = after["ci95"][0] > before["ci95"][1]
    kls = [row["kl"] for row in history if "kl" in row]
    pairs = [{"prompt": p, "before": b, "after": a}
             for p, b, a in zip(held_out, before["continuations"], after["continuations"])]
    summary = {"provenance": run_provenance(),
               "args": asdict(args), "before": before, "after": after, "improvement_significant": significant,
               "final_kl": kls[-1] if kls else None, "max_kl": max(kls) if kls else None,
               "wall_seconds": wall, "matmul_gflops_2_threads": gflops, "pairs": pairs, "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"), "RLHF: positive continuations")
    kl_text = f"; KL to the starting model {kls[-1]:.2f} at the end (max {max(kls):.2f})" if kls else ""
    print(f"held-out reward {before['mean_reward']:+.3f} -> {after['mean_reward']:+.3f} "
          f"({'significant' if significant else 'not significant'} at 95%){kl_text}; {wall / 60:.1f} minutes "
          f"(matmul {gflops:.0f} GFLOP/s on 2 threads); "
          f"results in {args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)
    for pair in pairs[:: max(1, len(pairs) // 5)][:5]:
        print(f"  {pair['prompt']!r}\n    before: {pair['before']!r}\n    after:  {pair['after']!r}", flush=True)


if __name__ == "__main__":
    main()
