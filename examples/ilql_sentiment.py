"""Offline ILQL with the built-in ``ilql`` updater, on the RLHF demo's task: continue neutral prompts positively.

    llmrl run --config configs/ilql-sentiment.yaml examples/ilql_sentiment.py
    llmrl run --config configs/ilql-sentiment-quick.yaml examples/ilql_sentiment.py --quick   # CI

1. **A dataset, made once, before any training.** The base model samples ``--candidates`` continuations of each
   training prompt; the RLHF demo's reward (VADER's sentiment minus its penalties for short or repetitive text)
   scores them, and the scores are standardised over the dataset (as trlX does).
2. **Offline training.** ``--epochs`` passes over the dataset, ``--prompts-per-update`` prompts (with all their
   continuations and rewards) per ``caller.update(prompts, continuations, rewards=...)``. Nothing is sampled.
3. **Before and after**, greedy continuations of the 72 held-out prompts and their mean reward with a 95% confidence
   interval: the base model, then after training the language model alone (ILQL's likelihood term trains it on
   the whole dataset) and the policy ILQL defines, steered by its advantages (``generate(..., steer={"beta": b})``:
   ``log_softmax(logits) + b * (Q - V)``) for each ``--betas``.

Writes, in ``--out``: ``curve.png`` (the losses per update, the held-out rewards), ``metrics.csv``,
``summary.json`` (the dataset's statistics, every evaluation with its continuations), and what the config's
``tracking`` back ends record. It shows a progress bar.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dpo_sentiment import evaluate  # noqa: E402
from rlhf_sentiment import Reward, build_prompts, mean_ci, write_metrics  # noqa: E402

from llmrl import Caller  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-prompts", type=int, default=288, help="training prompts (at most 288)")
    parser.add_argument("--candidates", type=int, default=4, help="continuations sampled per prompt")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the sampled continuations")
    parser.add_argument("--prompts-per-update", type=int, default=8, help="prompts per update")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="continuation length")
    parser.add_argument("--betas", default="0.5,1,2", help="advantage weights of the steered evaluations")
    parser.add_argument("--eval-prompts", type=int, default=72, help="held-out prompts in each evaluation (at most 72)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt order and the sampling")
    parser.add_argument("--out", default="runs/ilql_sentiment", help="where the curve, metrics and summary go")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (CI): 8 prompts, 8 held out")
    args = parser.parse_args()
    if args.quick:
        args.train_prompts, args.candidates, args.epochs, args.prompts_per_update = 8, 2, 1, 4
        args.eval_prompts, args.max_new_tokens, args.betas = 8, 8, "1"
    args.betas = [float(b) for b in str(args.betas).split(",") if b.strip()]
    return args


def make_dataset(caller: Caller, prompts: list[str], reward: Reward, args) -> tuple[list[tuple], dict]:
    """(prompt, continuations' token ids, standardised rewards) per prompt, and the raw rewards' statistics."""
    groups = caller.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                             temperature=1.0, num_return_sequences=args.candidates, seed=args.seed)
    raw = [[reward(s["text"]) for s in group] for group in groups]
    flat = [r for rs in raw for r in rs]
    mean, low, high = mean_ci(flat)
    std = (sum((r - mean) ** 2 for r in flat) / max(len(flat) - 1, 1)) ** 0.5 or 1.0
    data = [(p, [s["tokens"].tolist() for s in group], [(r - mean) / std for r in rs])
            for p, group, rs in zip(prompts, groups, raw)]
    stats = {"prompts": len(prompts), "continuations": len(flat), "mean_reward": mean, "ci95": [low, high],
             "std": std, "best_share_positive": sum(max(rs) > 0 for rs in raw) / len(raw)}
    print(f"dataset: {len(flat)} continuations of {len(prompts)} prompts, reward {mean:+.3f} (sd {std:.3f})",
          flush=True)
    return data, stats


def train(caller: Caller, data: list[tuple], args) -> list[dict]:
    from tqdm import tqdm

    rng = random.Random(args.seed)
    batches = []
    for _ in range(args.epochs):
        order = list(data)
        rng.shuffle(order)
        batches += [order[k:k + args.prompts_per_update] for k in range(0, len(order), args.prompts_per_update)]
    history = []
    keys = ("loss", "loss_q", "loss_v", "loss_cql", "loss_awac", "advantage", "value")
    for update, batch in enumerate(bar := tqdm(batches, desc="ILQL", unit="update"), 1):
        stats = caller.update([p for p, _, _ in batch], [c for _, c, _ in batch], rewards=[r for _, _, r in batch])
        tokens = [s["tokens"] for s in stats]  # the replicas' means, weighted by their tokens
        row = {"update": update, **{k: sum(s[k] * n for s, n in zip(stats, tokens)) / max(sum(tokens), 1)
                                    for k in keys}}
        history.append(row)
        caller.log({f"train/{key}": value for key, value in row.items() if key != "update"})
        bar.set_postfix(loss=f"{row['loss']:.3f}", adv=f"{row['advantage']:+.3f}")
    return history


def plot(history: list[dict], evaluations: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    x = [row["update"] for row in history]
    for key in ("loss", "loss_q", "loss_v", "loss_awac"):
        left.plot(x, [row[key] for row in history], label=key)
    left.set_xlabel("update")
    left.set_ylabel("loss per token")
    left.set_yscale("log")
    left.legend()
    left.set_title("Offline ILQL on the base model's own continuations")
    means = [e["mean_reward"] for e in evaluations]
    errors = [[m - e["ci95"][0] for m, e in zip(means, evaluations)],
              [e["ci95"][1] - m for m, e in zip(means, evaluations)]]
    right.bar(range(len(evaluations)), means, yerr=errors, capsize=4, color="#4c72b0")
    right.set_xticks(range(len(evaluations)), [e["label"].replace(", ", "\n") for e in evaluations], fontsize=8)
    right.set_ylabel("held-out reward (greedy, 95% CI)")
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
        before = evaluate(caller, held_out, reward, args, "base model")
        caller.log({"eval/mean_reward": before["mean_reward"]})
        data, data_stats = make_dataset(caller, train_prompts, reward, args)
        history = train(caller, data, args)
        evaluations = [before, evaluate(caller, held_out, reward, args, "after, language model alone")]
        for beta in args.betas:
            evaluations.append(evaluate(caller, held_out, reward, args, f"after, steered, beta {beta:g}",
                                        steer={"beta": beta}))
        best = max(evaluations[1:], key=lambda e: e["mean_reward"])
        caller.log({"eval/mean_reward": best["mean_reward"]})
    wall = time.time() - start
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = best["ci95"][0] > before["ci95"][1]
    summary = {"provenance": run_provenance(),
               "args": vars(args), "dataset": data_stats, "before": before, "after": evaluations[1:],
               "best_after": best["label"], "improvement_significant": significant, "wall_seconds": wall,
               "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, evaluations, os.path.join(args.out, "curve.png"))
    print(f"held-out reward {before['mean_reward']:+.3f} -> {best['mean_reward']:+.3f} ({best['label']}; "
          f"{'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; results in "
          f"{args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
