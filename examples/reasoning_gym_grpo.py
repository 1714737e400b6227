"""GRPO on a reasoning-gym task: SmolLM2-135M learns 1-digit arithmetic answers, scored by the dataset's own verifier.

    llmrl run --config configs/reasoning-gym-grpo.yaml examples/reasoning_gym_grpo.py
    llmrl run --config configs/rlhf-sentiment-script-quick.yaml examples/reasoning_gym_grpo.py --quick   # CI

The task is a :class:`llmrl.engine.envs.ReasoningGymTask` (``basic_arithmetic`` by default: two 1-digit terms, + and
-); a completion's reward is the dataset's ``score_answer`` on its last number (``answer_format="last_number"``: the
135M model answers in a sentence). The held-out questions are drawn past the training seeds, none of them a training
question, and measured with :meth:`Caller.evaluate` before and after training: the accuracy of the policy's samples
(pass@1 at temperature 1, the policy GRPO trains; the summary's ``mean_reward`` and ``ci95``) and of its greedy
answers, each with its 95% interval. The algorithm is the one of ``examples/rlhf_grpo_in_script.py``, written in
:func:`train`: per update, a group of sampled completions per question, group-normalised advantages,
``forward_backward`` with the ``importance_sampling`` loss against the sampler's log-probs, ``optim_step`` with a
linearly decaying learning rate.

Writes, in ``--out``: ``curve.png``, ``metrics.csv`` and ``summary.json`` (with both evaluations' reports), and what
the config's ``tracking`` back ends record. Needs reasoning-gym (the ``envs`` extra that ``setup.sh`` installs).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataclass_flags import flags_parser  # noqa: E402
from demo_outputs import before_after_bars, curve_and_bars_figure, write_metrics  # noqa: E402
from rlhf_grpo_in_script import group_advantages  # noqa: E402

from llmrl import Caller, completion_datum  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402

DATASET_ARGS = {  # the easy settings benchmarks/reasoning_gym_baseline.py measured the model on
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "count_bits": {"min_n": 1, "max_n": 15},
    "letter_counting": {"min_words": 1, "max_words": 3},
}


@dataclass
class Args:
    task: Annotated[str, "the reasoning-gym dataset (its settings: DATASET_ARGS, else the dataset's defaults)"] = \
        "basic_arithmetic"
    updates: Annotated[int, "GRPO updates"] = 40
    prompts_per_update: Annotated[int, "training questions per update"] = 8
    samples_per_prompt: Annotated[int, "completions sampled per question (the GRPO group)"] = 6
    max_new_tokens: Annotated[int, "completion length (training and evaluation)"] = 24
    lr: Annotated[float, "the first update's learning rate, decaying linearly to 0"] = 2e-3
    grad_clip_norm: Annotated[float, "gradients are clipped to this global norm"] = 1.0
    train_size: Annotated[int, "training entries (1-digit sums and differences: 200 distinct questions in all)"] = 100
    eval_size: Annotated[int, "held-out entries, none of them a training question"] = 100
    eval_samples: Annotated[int, "completions sampled per held-out question for pass@k (0: greedy only)"] = 4
    seed: Annotated[int, "seed of the training questions, their order and the sampling"] = 0
    out: Annotated[str, "where the curve, metrics and summary go"] = "runs/reasoning_gym_grpo"
    quick: Annotated[bool, "a tiny smoke run (CI): 2 updates, 4 questions of 2 samples, 8 held out"] = False


def train(caller: Caller, task, args: Args) -> list[dict]:
    import torch
    from tqdm import tqdm

    prompts = task.prompts()
    order, pool, history = random.Random(args.seed), [], []
    for update in (bar := tqdm(range(args.updates), desc=f"GRPO on {args.task}", unit="update")):
        start = time.time()
        if len(pool) < args.prompts_per_update:
            pool += order.sample(range(len(task)), len(task))
        batch, pool = pool[:args.prompts_per_update], pool[args.prompts_per_update:]
        ids = [t["ids"] for t in caller.tokenize([prompts[i] for i in batch])]  # as generate renders them
        groups = caller.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, num_return_sequences=args.samples_per_prompt,
                                 seed=args.seed * 100003 + update)
        rewards = [[task.reward(i, s["text"]) for s in group] for i, group in zip(batch, groups)]
        samples = [(context, s, a) for context, group, group_rewards in zip(ids, groups, rewards)
                   for s, a in zip(group, group_advantages(group_rewards)) if len(s["tokens"])]
        # each token's advantage is its completion's, divided by its length and the batch size: a mean over tokens,
        # then over the batch's completions
        data = [completion_datum(context, s["tokens"], logprobs=s["logprobs"],
                                 advantages=torch.full((len(s["tokens"]),), a / (len(s["tokens"]) * len(samples))))
                for context, s, a in samples]
        out = caller.forward_backward(data, "importance_sampling")
        lr = args.lr * (1 - update / args.updates)
        step = caller.optim_step({"learning_rate": lr, "grad_clip_norm": args.grad_clip_norm})
        flat = [r for group in rewards for r in group]
        history.append({"update": update + 1, "samples": len(flat), "reward": sum(flat) / len(flat),
                        "groups_with_signal": sum(len(set(g)) > 1 for g in rewards) / len(rewards),
                        "tokens": sum(len(s["tokens"]) for g in groups for s in g) / len(flat),
                        "loss": out["metrics"]["loss:sum"], "learning_rate": lr, "grad_norm": step["grad_norm"],
                        "seconds": time.time() - start})
        caller.log({f"train/{key}": history[-1][key] for key in ("reward", "groups_with_signal", "tokens", "loss")})
        bar.set_postfix(reward=f"{history[-1]['reward']:.2f}", tokens=f"{history[-1]['tokens']:.1f}")
    return history


def evaluate(caller: Caller, task, args: Args, label: str) -> dict:
    """The held-out accuracy, with 95% intervals: of the policy's samples (``eval_samples`` per question at the
    training temperature, the policy GRPO trains: ``mean_reward`` and ``ci95``) and of its greedy answers."""
    report = caller.evaluate(task, samples=args.eval_samples, temperature=1.0, seed=args.seed,
                             max_new_tokens=args.max_new_tokens)
    greedy = report["greedy"]["pass@1"]
    measure = report["sampled"]["pass@1"] if args.eval_samples else greedy
    report["mean_reward"], report["ci95"] = measure["value"], measure["ci"] or [measure["value"]] * 2
    sampled = f"sampled pass@1 {measure['value']:.3f} (95% CI {report['ci95'][0]:.3f} to {report['ci95'][1]:.3f}), " \
        if args.eval_samples else ""
    low, high = greedy["ci"] or [greedy["value"]] * 2
    print(f"{label}: held-out accuracy over {report['prompts']} questions: {sampled}greedy {greedy['value']:.3f} "
          f"(95% CI {low:.3f} to {high:.3f})", flush=True)
    return report


def plot(history: list[dict], before: dict, after: dict, path: str, title: str) -> None:
    """``curve.png``: the training reward and completion length per update; the held-out accuracy of the samples
    before and after as bars (95% intervals), the greedy accuracy as black diamonds with theirs."""
    plt, fig, left, right = curve_and_bars_figure()
    x = [row["update"] for row in history]
    left.plot(x, [row["reward"] for row in history], "o-", label="training reward (sampled, score_answer)")
    left.set_xlabel("update")
    left.set_ylabel("reward")
    left.set_title(title)
    tokens = left.twinx()
    tokens.plot(x, [row["tokens"] for row in history], "s--", color="#c44e52", label="tokens per completion")
    tokens.set_ylabel("tokens")
    left.legend(loc="upper left")
    tokens.legend(loc="center right")
    before_after_bars(right, before, after)
    greedy = [report["greedy"]["pass@1"] for report in (before, after)]
    values = [g["value"] for g in greedy]
    errors = [[v - (g["ci"] or [v, v])[0] for v, g in zip(values, greedy)],
              [(g["ci"] or [v, v])[1] - v for v, g in zip(values, greedy)]]
    right.errorbar([0, 1], values, yerr=errors, fmt="kD", capsize=4)
    right.set_title(f"{before['prompts']} held-out questions\n(95% CI): sampled as bars,\ngreedy as diamonds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> Args:
    parser = flags_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args.updates, args.prompts_per_update, args.samples_per_prompt = 2, 4, 2
        args.train_size, args.eval_size, args.eval_samples, args.max_new_tokens = 16, 8, 2, 8
    return args


def main() -> None:
    args = parse_args()
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    from llmrl.engine.envs import ReasoningGymTask

    start = time.time()
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        chat = bool(getattr(caller.tokenizer, "chat_template", None))  # a tiny test model has none: text prompts
        train_task = ReasoningGymTask(args.task, size=args.train_size, seed=args.seed, answer_format="last_number",
                                      dataset_args=DATASET_ARGS.get(args.task), chat=chat)
        held_out = train_task.held_out(size=args.eval_size)
        before = evaluate(caller, held_out, args, "before training")
        history = train(caller, train_task, args)
        after = evaluate(caller, held_out, args, "after training")
    wall = time.time() - start
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    significant = after["ci95"][0] > before["ci95"][1]
    greedy = [report["greedy"]["pass@1"] for report in (before, after)]
    summary = {"provenance": run_provenance(), "args": asdict(args),
               "measure": "sampled pass@1 (temperature 1)" if args.eval_samples else "greedy pass@1",
               "before": {k: v for k, v in before.items() if k != "per_prompt"},
               "after": {k: v for k, v in after.items() if k != "per_prompt"},
               "improvement_significant": significant,
               "greedy_improvement_significant": bool(greedy[0]["ci"] and greedy[1]["ci"]
                                                      and greedy[1]["ci"][0] > greedy[0]["ci"][1]),
               "wall_seconds": wall, "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"), f"GRPO on {args.task}")
    print(f"held-out {summary['measure']} {before['mean_reward']:.3f} -> {after['mean_reward']:.3f} "
          f"({'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; "
          f"results in {args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
