"""Synchronous against asynchronous GRPO, back to back: the in-script GRPO demo (``examples/rlhf_grpo_in_script.py``)
run with ``--async-staleness`` 0 (sample, then train), 1 and 2 (sample on a background thread within that many
optimizer steps of the trained weights), back to back on one machine, and a table of their time per update, the
time each update waited for its samples, the held-out reward before and after, and the sampler/learner mismatch.

    .venv/bin/python -m benchmarks.async_grpo [--config configs/rlhf-sentiment-script.yaml] [--staleness 0,1,2]
        [--sampler-staleness 1] [--sampler-config configs/rlhf-sentiment-script-sampler.yaml]
        [--out runs/async_grpo] [--quick]
    .venv/bin/python -m benchmarks.async_grpo --summarize runs/async_grpo     # the table of runs already made

Each run is ``llmrl run --config CONFIG examples/rlhf_grpo_in_script.py --async-staleness K --out OUT/staleness-K``
(its summary.json, metrics.csv and curve.png go there). Each ``--sampler-staleness`` K adds a run that samples on
an LLM of its own (``--sampler-config``'s ``sampler``, on its own rank; the policy's adapter synced into it after
every step) into ``OUT/staleness-K-sampler``, its row named ``K+sampler``. The ratios are the synchronous run's
median seconds per update over each run's. The model for N devices: with sampling and training on separate
devices, an update takes max(sampling, training) instead of their sum; the synchronous run's
``waited_for_samples`` is the sampling time and the rest of its update the training time, so the bound on the
speed-up is (sampling + training) / max(sampling, training). It writes ``OUT/async_grpo.json``; it changes no
file outside ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, staleness: int, out: str, quick: bool, sampler: bool = False) -> None:
    cmd = [os.path.join(os.path.dirname(sys.executable), "llmrl"), "run", "--config", config,
           os.path.join(ROOT, "examples", "rlhf_grpo_in_script.py"), "--async-staleness", str(staleness),
           "--out", out, *(["--quick"] if quick else []), *(["--sampler", "sampler"] if sampler else [])]
    print(f"staleness {staleness}{' (sampler rank)' if sampler else ''}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def summarize(folder: str, staleness: list[int], sampler_staleness: list[int] = ()) -> dict:
    rows = {}
    labels = [(k, f"staleness-{k}") for k in staleness] + [(f"{k}+sampler", f"staleness-{k}-sampler")
                                                           for k in sampler_staleness]
    for k, name in labels:
        with open(os.path.join(folder, name, "summary.json")) as f:
            summary = json.load(f)
        history = summary["history"]
        rows[k] = {
            "seconds_per_update": statistics.median(r["seconds"] for r in history),
            "waited_for_samples": statistics.median(r["waited_for_samples"] for r in history),
            "wall_seconds": summary["wall_seconds"],
            "held_out_before": [summary["before"]["mean_reward"], *summary["before"]["ci95"]],
            "held_out_after": [summary["after"]["mean_reward"], *summary["after"]["ci95"]],
            "staleness_max": max(r["staleness_max"] for r in history),
            "dropped_batches": sum(r.get("dropped", 0) for r in history),
            "ratio_max": max(r["ratio_max"] for r in history),
            "kl_sampler_learner_mean": statistics.fmean(r["kl_sampler_learner"] for r in history),
            "commit": summary["provenance"]["commit"], "date": summary["provenance"]["date"],
            "hardware": summary["provenance"]["hardware"]}
    base = rows[min(staleness)]
    sampling = base["waited_for_samples"]
    training = base["seconds_per_update"] - sampling
    for row in rows.values():
        row["speed_up"] = base["seconds_per_update"] / row["seconds_per_update"]
    model = {"sampling_seconds": sampling, "training_seconds": training,
             "speed_up_bound_on_separate_devices": (sampling + training) / max(sampling, training)}
    return {"rows": rows, "model": model}


def print_table(result: dict) -> None:
    print("| staleness | s/update (median) | waited for samples | speed-up | held-out reward before -> after "
          "(95% CI) | max staleness | batches dropped | max ratio | KL(sampler, learner) per token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, r in result["rows"].items():
        b, a = r["held_out_before"], r["held_out_after"]
        print(f"| {k} | {r['seconds_per_update']:.2f} | {r['waited_for_samples']:.2f} | {r['speed_up']:.2f}x | "
              f"{b[0]:+.3f} -> {a[0]:+.3f} ({a[1]:+.3f} to {a[2]:+.3f}) | {r['staleness_max']:g} | "
              f"{r.get('dropped_batches', 0):g} | {r['ratio_max']:.3f} | {r['kl_sampler_learner_mean']:.4f} |")
    m = result["model"]
    print(f"model: sampling {m['sampling_seconds']:.2f} s + training {m['training_seconds']:.2f} s per synchronous "
          f"update; on separate devices an update takes the longer of the two: at most "
          f"{m['speed_up_bound_on_separate_devices']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "rlhf-sentiment-script.yaml"))
    parser.add_argument("--staleness", default="0,1,2", help="comma-separated; the smallest is the baseline")
    parser.add_argument("--sampler-staleness", default="1",
                        help="comma-separated; a run sampling on a sampler LLM of its own at each (empty: none)")
    parser.add_argument("--sampler-config",
                        default=os.path.join(ROOT, "configs", "rlhf-sentiment-script-sampler.yaml"))
    parser.add_argument("--out", default="runs/async_grpo")
    parser.add_argument("--quick", action="store_true", help="the demo's --quick runs (a tiny model config)")
    parser.add_argument("--summarize", metavar="FOLDER", help="print the table of the runs in FOLDER, run nothing")
    args = parser.parse_args()
    staleness = sorted(int(k) for k in args.staleness.split(","))
    with_sampler = sorted(int(k) for k in args.sampler_staleness.split(",") if k.strip())
    folder = args.summarize or args.out
    if not args.summarize:
        start = time.time()
        for k in staleness:
            run(args.config, k, os.path.join(folder, f"staleness-{k}"), args.quick)
        for k in with_sampler:
            run(args.sampler_config, k, os.path.join(folder, f"staleness-{k}-sampler"), args.quick, sampler=True)
        print(f"{len(staleness) + len(with_sampler)} runs in {(time.time() - start) / 60:.1f} minutes", flush=True)
    result = {"written by": "llmrl benchmarks.async_grpo", **summarize(folder, staleness, with_sampler)}
    path = os.path.join(folder, "async_grpo.json")
    if os.path.exists(path):  # a file of the user's own there is never overwritten
        with open(path) as f:
            try:
                ours = json.load(f).get("written by") == result["written by"]
            except (ValueError, AttributeError):
                ours = False
        if not ours:
            sys.exit(f"{path} exists and was not written by this benchmark: move it, or give another --out")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)


if __name__ == "__main__":
    main()
