"""DPO written in your script: a loss on log-probs, run with forward_backward_custom, against a frozen snapshot.

    llmrl run --config configs/rlhf-sentiment-script.yaml examples/dpo_in_script.py
    llmrl run --config configs/rlhf-sentiment-script-quick.yaml examples/dpo_in_script.py --quick   # CI

Preference pairs are built here from word lists (no download): a prompt from the RLHF demo, a negative
continuation (chosen: the policy learns to be a grumpy critic, the opposite of what SmolLM prefers before
training) and a positive one (rejected). Before training the script takes a snapshot of the policy
(``caller.snapshot("reference")``) and reads the reference log-probs from it with ``forward``. Each step runs
:func:`dpo_loss` (Rafailov et al., 2023: ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``) on the
client through ``forward_backward_custom``: the servers return the per-token log-probs, autograd gives the loss's
derivative with respect to each, and the servers back-propagate them (the exact gradient of the loss, with no
plugin). ``optim_step`` takes the step. Held-out pairs (other adjectives and subjects, never trained on) measure
how often the policy prefers the chosen continuation, before and after, with 95% confidence intervals.

Writes, in ``--out``: ``curve.png`` (loss and held-out preference), ``metrics.csv``, ``summary.json``, and what the
config's ``tracking`` back ends record (each ``optim_step``'s statistics, the loss's metrics through ``caller.log``)
in a folder named after the run. It does not generate text: it trains and measures preferences between given
continuations only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_outputs import before_after_bars, write_metrics  # noqa: E402
from rlhf_sentiment import FRAMES, HELD_OUT_SUBJECTS, SUBJECTS  # noqa: E402

from llmrl import Caller, completion_datum  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402

GOOD = ["wonderful", "great", "lovely", "excellent", "delightful", "fantastic", "pleasant", "superb"]
BAD = ["terrible", "awful", "horrible", "dreadful", "miserable", "disappointing", "unpleasant", "boring"]
HELD_OUT_GOOD, HELD_OUT_BAD = ["amazing", "beautiful", "brilliant"], ["painful", "annoying", "ugly"]


def pairs(subjects, good, bad, count: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """``count`` (prompt, chosen, rejected) triples: the negative continuation is the chosen one."""
    out = []
    for _ in range(count):
        prompt = rng.choice(FRAMES).format(s=rng.choice(subjects))
        out.append((prompt, f" {rng.choice(bad)} and I regretted it.", f" {rng.choice(good)} and I enjoyed it."))
    return out


def dpo_loss(beta: float, lengths: list[int], reference: list):
    """The DPO loss over datums (chosen, rejected, chosen, rejected, ...): ``lengths`` are the completions' token
    counts, ``reference`` their reference log-probs."""
    import torch

    def loss_fn(data, logprobs):
        margins = []
        for k in range(0, len(data), 2):
            chosen = (logprobs[k][-lengths[k]:] - reference[k]).sum()
            rejected = (logprobs[k + 1][-lengths[k + 1]:] - reference[k + 1]).sum()
            margins.append(beta * (chosen - rejected))
        margins = torch.stack(margins)
        loss = -torch.nn.functional.logsigmoid(margins).mean()
        margins = margins.detach()
        return loss, {"accuracy": float((margins > 0).float().mean()), "margin": float(margins.mean())}

    return loss_fn


def preference(caller: Caller, held_out) -> dict:
    """How often the policy gives the chosen continuation a higher log-prob, with its 95% interval."""
    scores = caller.score([p for p, _, _ in held_out], [[c, r] for _, c, r in held_out])
    wins = [float(s[0] > s[1]) for s in scores]
    n, rate, z = len(wins), sum(wins) / len(wins), 1.96
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)  # Wilson's interval: sound at 0% and 100% too
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = max(0.0, min(rate, centre - half)), min(1.0, max(rate, centre + half))  # holds rate at 100% too
    return {"rate": rate, "ci95": [low, high], "pairs": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--pairs-per-step", type=int, default=8, help="preference pairs per step")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta: the KL weight")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair order and the model's new weights")
    parser.add_argument("--out", default="runs/dpo_in_script", help="where the curve, metrics and summary go")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (CI): 2 steps, 16 held-out pairs")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pairs_per_step = 2, 2
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    rng = random.Random(args.seed)
    held_out = pairs(HELD_OUT_SUBJECTS, HELD_OUT_GOOD, HELD_OUT_BAD, 16 if args.quick else 100, rng)
    start, history = time.time(), []
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        before = preference(caller, held_out)
        caller.log({"eval/preference_rate": before["rate"]})  # step 0: before any optim_step
        print(f"before: the policy prefers the chosen continuation in {before['rate']:.0%} of held-out pairs",
              flush=True)
        caller.snapshot("reference")
        from tqdm import tqdm

        for step in tqdm(range(args.steps), desc="DPO in the script", unit="step"):
            batch = pairs(SUBJECTS, GOOD, BAD, args.pairs_per_step, rng)
            plans = caller.tokenize([p for p, _, _ in batch], [[c, r] for _, c, r in batch])
            data, lengths = [], []
            for plan in plans:
                for candidate in plan["candidates"]:  # chosen, then rejected: the tokens score would read
                    prompt = plan["ids"][:len(plan["ids"]) - candidate["merged_context_tokens"]]
                    data.append(completion_datum(prompt, candidate["ids"]))
                    lengths.append(len(candidate["ids"]))
            reference = [out["logprobs"][-n:] for out, n in
                         zip(caller.forward(data, peft_adapter="reference")["loss_fn_outputs"], lengths)]
            out = caller.forward_backward_custom(data, dpo_loss(args.beta, lengths, reference))
            caller.optim_step({"learning_rate": args.lr * (1 - step / args.steps)})
            history.append({"step": step + 1, **out["metrics"]})
            caller.log({f"train/{key}": value for key, value in out["metrics"].items()})  # at this optim_step's step
        after = preference(caller, held_out)
        caller.log({"eval/preference_rate": after["rate"]})
    wall = time.time() - start
    print(f"held-out preference for the chosen continuation {before['rate']:.0%} "
          f"({before['ci95'][0]:.0%} to {before['ci95'][1]:.0%}) -> {after['rate']:.0%} "
          f"({after['ci95'][0]:.0%} to {after['ci95'][1]:.0%}); {wall / 60:.1f} minutes; results in {args.out}/",
          flush=True)
    write_metrics(history, os.path.join(args.out, "metrics.csv"))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"provenance": run_provenance(),
                   "args": vars(args), "before": before, "after": after, "wall_seconds": wall, "history": history},
                  f, indent=2)
    plot(history, before, after, os.path.join(args.out, "curve.png"))


def plot(history: list[dict], before: dict, after: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    left.plot([h["step"] for h in history], [h["loss"] for h in history], "o-", label="DPO loss")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title("DPO written in the script")
    left.legend()
    before_after_bars(right, before, after, key="rate")
    right.set_title(f"held-out preference\n({before['pairs']} pairs, 95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
