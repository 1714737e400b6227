"""GRPO with your own prompts and your own reward function: the built-in ``grpo`` updater trains, this script feeds it.

    llmrl run --config configs/gpu-grpo.yaml examples/grpo_custom_reward.py                  # 4 GPUs, Qwen2.5-1.5B
    llmrl run --config configs/gpu-grpo.yaml examples/grpo_custom_reward.py \\
        --prompts my_prompts.jsonl --reward my_reward:score                                  # your data, your reward
    llmrl run --config configs/gpu-grpo.yaml llms.policy.model=builtin:smollm2-135m-instruct \\
        llms.policy.dtype=float32 llms.policy.devices=cpu llms.policy.replicas=1 \\
        examples/grpo_custom_reward.py --quick                                               # a CPU check

Prompts: ``--prompts FILE``, a JSONL file with one object per line holding a ``"prompt"`` (a string, or a list of
chat messages) and any other fields (an answer, test cases); or, without it, built-in arithmetic questions
(``"What is 47 * 38 - 19?"``, answer in the ``"answer"`` field). The last ``--eval-size`` prompts are held out.
A string prompt is sent as one user message through the model's chat template (``--no-chat``: as plain text).

Reward: ``--reward module:function`` (a module on the current folder or the ``PYTHONPATH``), called as TRL calls
its reward functions: ``function(prompts, completions, **fields) -> list[float]``, one list entry per completion,
with each prompt repeated for each of its completions and every other JSONL field passed as a list aligned with them.
Without it, :func:`arithmetic_reward`: 1.0 when the last number of the completion is the answer, else 0.0.

Each update samples ``--group-size`` completions of ``--prompts-per-update`` training prompts with ``generate``
(``do_sample``, temperature 1, no top-k or top-p truncation: the returned log-probs are the sampler's), scores them
with the reward, and calls ``update`` with the prompts, the completions' token ids, the rewards and those
log-probs; the config's ``grpo`` updater computes group-relative advantages and takes the step on every replica.
Before and after training it answers the held-out prompts greedily and reports their mean reward with a 95%
confidence interval.

Writes, in ``--out``: ``curve.png`` (training reward and KL per update, held-out reward before and after),
``metrics.csv`` (one row per update) and ``summary.json`` (arguments, evaluations, every held-out completion before
and after, timings), and the config's ``tracking`` back ends' files.

It imports two helpers from its own folder (``dataclass_flags.py``: the flags; ``demo_outputs.py``: metrics.csv and
the figure's parts): copy them with it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated

from dataclass_flags import flags_parser  # the examples' folder: on the path as the script's own
from demo_outputs import reward_curve, write_metrics

from llmrl import Caller
from llmrl.engine.output_folder import claim_output_folder
from llmrl.engine.provenance import run_provenance


@dataclass
class Args:
    prompts: Annotated[str, "a JSONL file: one {\"prompt\": ..., other fields} per line (default: arithmetic)"] = ""
    reward: Annotated[str, "module:function, TRL's signature f(prompts, completions, **fields) (default: "
                           "arithmetic_reward)"] = ""
    eval_size: Annotated[int, "the last prompts held out for evaluation"] = 64
    updates: Annotated[int, "GRPO updates (one optimizer step each with configs/gpu-grpo.yaml)"] = 100
    prompts_per_update: Annotated[int, "training prompts per update"] = 32
    group_size: Annotated[int, "completions sampled per prompt (TRL's num_generations)"] = 8
    max_new_tokens: Annotated[int, "completion length (TRL's max_completion_length)"] = 256
    chat: Annotated[bool, "send a string prompt as a user message through the chat template"] = True
    seed: Annotated[int, "seed of the prompt order and the sampling"] = 0
    out: Annotated[str, "where the curve, metrics and summary go"] = "runs/grpo_custom_reward"
    quick: Annotated[bool, "a tiny check: 2 updates of 2 prompts x 2 completions of 16 tokens, 4 held out"] = False


# ---------------------------------------------------------------------------------------------- prompts and reward
def arithmetic_prompts(count: int, seed: int) -> list[dict]:
    """``count`` questions ``a * b - c`` with their answers (the default data set)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 99)
        rows.append({"prompt": f"What is {a} * {b} - {c}? Think step by step, then give the final number.",
                     "answer": str(a * b - c)})
    return rows


def arithmetic_reward(prompts: list, completions: list[str], answer: list[str], **fields) -> list[float]:
    """1.0 when the completion's last number is the answer, else 0.0 (TRL's reward-function signature)."""
    rewards = []
    for text, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        last = numbers[-1].replace(",", "").rstrip(".") if numbers else None
        rewards.append(1.0 if last == str(expected) else 0.0)
    return rewards


def load_prompts(path: str) -> list[dict]:
    """The JSONL file's rows, each with a ``prompt``; errors name the line."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "prompt" not in row:
                raise SystemExit(f"{path}:{number}: each line must be a JSON object with a \"prompt\"")
            rows.append(row)
    return rows


def load_reward(spec: str):
    """``module:function`` imported from the current folder or the PYTHONPATH."""
    if not spec:
        return arithmetic_reward
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--reward {spec!r}: write module:function, e.g. my_reward:score")
    sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), name)


def context(row: dict, chat: bool):
    """What ``generate`` and ``update`` read: chat messages (rendered with the served tokenizer's template) or text."""
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if chat and isinstance(prompt, str) else prompt


def rewards_for(reward_fn, rows: list[dict], groups: list[list[str]]) -> list[list[float]]:
    """Call the reward function once over every completion, TRL's way, and regroup the results per prompt."""
    flat_rows = [row for row, group in zip(rows, groups) for _ in group]
    fields = {key: [row.get(key) for row in flat_rows] for key in {k for row in rows for k in row} - {"prompt"}}
    flat = reward_fn([row["prompt"] for row in flat_rows], [text for group in groups for text in group], **fields)
    if len(flat) != len(flat_rows):
        raise SystemExit(f"the reward function returned {len(flat)} values for {len(flat_rows)} completions")
    out, first = [], 0
    for group in groups:
        out.append([float(r) for r in flat[first:first + len(group)]])
        first += len(group)
    return out


# ----------------------------------------------------------------------------------------------- training and eval
def mean_ci(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and its 95% confidence interval (normal approximation)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(n - 1, 1))
    return mean, mean - z * std / math.sqrt(n), mean + z * std / math.sqrt(n)


def evaluate(caller: Caller, rows: list[dict], reward_fn, args: Args, label: str) -> dict:
    """Greedy completions of the held-out prompts and their mean reward."""
    samples = caller.generate([context(r, args.chat) for r in rows], max_new_tokens=args.max_new_tokens,
                              do_sample=False)
    texts = [group[0]["text"] for group in samples]
    rewards = [group[0] for group in rewards_for(reward_fn, rows, [[t] for t in texts])]
    mean, low, high = mean_ci(rewards)
    print(f"{label}: held-out reward {mean:.3f} (95% CI {low:.3f} to {high:.3f}) over {len(rows)} prompts",
          flush=True)
    return {"label": label, "prompts": len(rows), "mean_reward": mean, "ci95": [low, high],
            "completions": texts, "rewards": rewards}


def train(caller: Caller, rows: list[dict], reward_fn, args: Args) -> list[dict]:
    from tqdm import tqdm

    order, pool, history = random.Random(args.seed), [], []
    for update in (bar := tqdm(range(args.updates), desc="GRPO", unit="update")):
        start = time.time()
        if len(pool) < args.prompts_per_update:
            pool += order.sample(rows, len(rows))
        batch, pool = pool[:args.prompts_per_update], pool[args.prompts_per_update:]
        contexts = [context(r, args.chat) for r in batch]
        samples = caller.generate(contexts, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, num_return_sequences=args.group_size,
                                  seed=args.seed * 100003 + update)
        rewards = rewards_for(reward_fn, batch, [[s["text"] for s in group] for group in samples])
        generate_seconds = time.time() - start
        stats = caller.update(contexts, [[s["tokens"] for s in group] for group in samples], rewards=rewards,
                              old_logprobs=[[s["logprobs"] for s in group] for group in samples])
        flat = [r for group in rewards for r in group]
        row = {"update": update + 1, "completions": len(flat), "reward": sum(flat) / len(flat),
               "mean_tokens": sum(len(s["tokens"]) for g in samples for s in g) / len(flat),
               "generate_seconds": generate_seconds, "update_seconds": time.time() - start - generate_seconds}
        n = sum(s["samples"] for s in stats)  # one dict per replica; weigh each by its prompts
        for key in ("kl", "kl_penalty", "policy_loss", "approx_kl", "clip_fraction", "reward_std"):
            if all(key in s for s in stats):
                row[key] = sum(s[key] * s["samples"] for s in stats) / max(n, 1)
        history.append(row)
        caller.log({f"train/{key}": row[key] for key in ("reward", "mean_tokens", "generate_seconds")})
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row.get('kl', 0.0):.3f}")
    return history


# ------------------------------------------------------------------------------------------------------- outputs
def plot(history: list[dict], before: dict, after: dict, path: str) -> None:
    reward_curve(history, before, after, path, title="GRPO with your prompts and reward", reward_label="mean reward",
                 kl_label="KL to the base model", kl_unit="completion")


def parse_args() -> Args:
    parser = flags_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args.updates, args.prompts_per_update, args.group_size, args.eval_size = 2, 2, 2, 4
        args.max_new_tokens = 16
    return args


def main() -> None:
    args = parse_args()
    rows = load_prompts(args.prompts) if args.prompts else arithmetic_prompts(2000 + args.eval_size, args.seed)
    if len(rows) <= args.eval_size:
        raise SystemExit(f"{len(rows)} prompts: need more than --eval-size {args.eval_size} (the held-out ones)")
    train_rows, held_out = rows[:-args.eval_size], rows[-args.eval_size:]
    reward_fn = load_reward(args.reward)
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    start = time.time()
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        print(f"llmrl: {caller.info}", flush=True)
        before = evaluate(caller, held_out, reward_fn, args, "before training")
        caller.log({"eval/mean_reward": before["mean_reward"]})  # step 0: before any update
        history = train(caller, train_rows, reward_fn, args)
        after = evaluate(caller, held_out, reward_fn, args, "after training")
        caller.log({"eval/mean_reward": after["mean_reward"]})  # at the last update's step
    wall = time.time() - start
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = after["ci95"][0] > before["ci95"][1]
    pairs = [{"prompt": r["prompt"], "before": b, "after": a}
             for r, b, a in zip(held_out, before["completions"], after["completions"])]
    summary = {"provenance": run_provenance(),
               "args": asdict(args), "before": before, "after": after, "improvement_significant": significant,
               "wall_seconds": wall, "pairs": pairs, "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"))
    print(f"held-out reward {before['mean_reward']:.3f} -> {after['mean_reward']:.3f} "
          f"({'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; "
          f"results in {args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
