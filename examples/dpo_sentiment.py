"""Offline DPO with the built-in ``dpo`` updater, on the RLHF demo's task: continue neutral prompts positively.

    llmrl run --config configs/dpo-sentiment.yaml examples/dpo_sentiment.py
    llmrl run --config configs/dpo-sentiment-quick.yaml examples/dpo_sentiment.py --quick   # CI

1. **Pairs, made offline, before any training.** For each training prompt the base model samples
   ``--candidates`` continuations (one ``generate`` call); the RLHF demo's reward (VADER's sentiment minus its
   penalties for short or repetitive text) ranks them; the best becomes the chosen continuation and the worst the
   rejected one. Prompts whose best and worst differ by less than ``--min-gap`` give no pair.
2. **Training on the fixed pairs.** ``--epochs`` passes over them, ``--pairs-per-update`` per
   ``caller.update(prompts, [[chosen, rejected], ...])``. The config picks the updater (``dpo``: the loss, ``beta``,
   the reference: the model with its LoRA adapters disabled). Nothing is sampled during training.
3. **Before and after**, greedy continuations of the 72 held-out prompts and their mean reward with a 95% confidence
   interval, as the RLHF demo measures.

Writes, in ``--out``: ``curve.png`` (the DPO loss and reward accuracy per update, the held-out reward before and
after), ``metrics.csv``, ``summary.json`` (the pairs' statistics, both evaluations with their continuations), and
what the config's ``tracking`` back ends record. It shows a progress bar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_outputs import before_after_bars, write_metrics  # noqa: E402
from rlhf_sentiment import Reward, build_prompts, mean_ci  # noqa: E402

from llmrl import Caller  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-prompts", type=int, default=288, help="training prompts (at most 288)")
    parser.add_argument("--candidates", type=int, default=4, help="continuations sampled per prompt")
    parser.add_argument("--min-gap", type=float, default=0.2, help="least reward gap between chosen and rejected")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the preference pairs")
    parser.add_argument("--pairs-per-update", type=int, default=16, help="preference pairs per update")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="continuation length")
    parser.add_argument("--eval-prompts", type=int, default=72, help="held-out prompts in each evaluation (at most 72)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt order and the sampling")
    parser.add_argument("--out", default="runs/dpo_sentiment", help="where the curve, metrics and summary go")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (CI): 8 prompts, 8 held out")
    args = parser.parse_args()
    if args.quick:
        args.train_prompts, args.candidates, args.epochs, args.pairs_per_update = 8, 2, 1, 4
        args.eval_prompts, args.max_new_tokens, args.min_gap = 8, 8, 0.0
    return args


def evaluate(caller: Caller, prompts: list[str], reward: Reward, args, label: str, **generate_kwargs) -> dict:
    """Greedy continuations of the held-out prompts (``generate_kwargs`` added, e.g. ``steer``), their mean reward
    with its 95% confidence interval."""
    samples = caller.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=False, **generate_kwargs)
    texts = [group[0]["text"] for group in samples]
    rewards = [reward(t) for t in texts]
    mean, low, high = mean_ci(rewards)
    print(f"{label}: held-out reward {mean:+.3f} (95% CI {low:+.3f} to {high:+.3f}) over {len(prompts)} prompts",
          flush=True)
    return {"label": label, "prompts": len(prompts), "mean_reward": mean, "ci95": [low, high],
            "continuations": texts, "rewards": rewards}


def make_pairs(caller: Caller, prompts: list[str], reward: Reward, args) -> tuple[list[tuple], dict]:
    """(prompt, chosen tokens, rejected tokens) for every prompt whose samples differ enough; their statistics."""
    groups = caller.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                             temperature=1.0, num_return_sequences=args.candidates, seed=args.seed)
    pairs, gaps, chosen_rewards, rejected_rewards = [], [], [], []
    for prompt, group in zip(prompts, groups):
        scored = sorted(((reward(s["text"]), s["tokens"].tolist()) for s in group), key=lambda x: x[0])
        (low, worst), (high, best) = scored[0], scored[-1]
        if high - low < args.min_gap or best == worst:
            continue
        pairs.append((prompt, best, worst))
        gaps.append(high - low)
        chosen_rewards.append(high)
        rejected_rewards.append(low)
    stats = {"prompts": len(prompts), "pairs": len(pairs),
             "mean_chosen_reward": sum(chosen_rewards) / max(len(pairs), 1),
             "mean_rejected_reward": sum(rejected_rewards) / max(len(pairs), 1),
             "mean_gap": sum(gaps) / max(len(pairs), 1)}
    print(f"pairs: {len(pairs)} of {len(prompts)} prompts; chosen {stats['mean_chosen_reward']:+.3f}, rejected "
          f"{stats['mean_rejected_reward']:+.3f} on average", flush=True)
    return pairs, stats


def train(caller: Caller, pairs: list[tuple], args) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(args.seed)
    batches = []
    for _ in range(args.epochs):
        order = list(pairs)
        rng.shuffle(order)
        batches += [order[k:k + args.pairs_per_update] for k in range(0, len(order), args.pairs_per_update)]
    history = []
    for update, batch in enumerate(tqdm(batches, desc="DPO", unit="update"), 1):
        stats = caller.update([p for p, _, _ in batch], [[c, r] for _, c, r in batch])
        shares = [s["samples"] for s in stats]  # the replicas' means, weighted by their shares
        row = {"update": update, **{key: sum(s[key] * n for s, n in zip(stats, shares)) / sum(shares)
                                    for key in ("loss", "reward_accuracy", "reward_margin")}}
        history.append(row)
        caller.log({f"train/{key}": value for key, value in row.items() if key != "update"})
    return history


def plot(history: list[dict], before: dict, after: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = [row["update"] for row in history]
    left.plot(x, [row["loss"] for row in history], "o-", label="DPO loss")
    left.set_xlabel("update")
    left.set_ylabel("loss")
    accuracy = left.twinx()
    accuracy.plot(x, [row["reward_accuracy"] for row in history], "s--", color="#c44e52", label="reward accuracy")
    accuracy.set_ylabel("share of pairs ranked right")
    accuracy.legend(loc="lower right")
    left.legend(loc="upper left")
    left.set_title("Offline DPO on sampled, reward-ranked pairs")
    before_after_bars(right, before, after)
    right.set_title(f"greedy, {before['prompts']} held-out\nprompts (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    train_prompts, held_out = build_prompts()
    train_prompts = random.Random(args.seed).sample(train_prompts, min(args.train_prompts, len(train_prompts)))
    held_out = held_out[: args.eval_prompts]
    reward = Reward(short_penalty=0.5, repeat_penalty=1.0)
    start = time.time()
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        before = evaluate(caller, held_out, reward, args, "before training")
        caller.log({"eval/mean_reward": before["mean_reward"]})
        pairs, pair_stats = make_pairs(caller, train_prompts, reward, args)
        if not pairs:
            raise SystemExit("no pair: every prompt's samples scored alike; lower --min-gap or raise --candidates")
        history = train(caller, pairs, args)
        after = evaluate(caller, held_out, reward, args, "after training")
        caller.log({"eval/mean_reward": after["mean_reward"]})
    wall = time.time() - start
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = after["ci95"][0] > before["ci95"][1]
    summary = {"provenance": run_provenance(),
               "args": vars(args), "pairs": pair_stats, "before": before, "after": after,
               "improvement_significant": significant, "wall_seconds": wall, "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"))
    print(f"held-out reward {before['mean_reward']:+.3f} -> {after['mean_reward']:+.3f} "
          f"({'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; results in "
          f"{args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
