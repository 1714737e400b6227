"""``Caller.evaluate`` through a live run (the tiny Llama): the greedy and sampled rewards it reports are the task's
reward of what ``generate`` returns for the same prompts and seed (called directly, the reference), its pass@k is
Chen et al.'s estimator over those by hand, a second evaluation with the same seed repeats it, and its scalars
are written to the run's CSV tracker at the current step."""

from __future__ import annotations

import csv
import math

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["You see a door.", "Goal: go to the red ball", "x x x", "In the kitchen"]


def test_evaluate_matches_generate_and_repeats_with_its_seed(live_run, tiny, tmp_path):
    from llmrl.engine.envs import FunctionTask
    from testkit.envs import even_length_reward

    config = {"llms": {"main": {"model": tiny["llama"]}}, "threads_per_rank": 1,
              "tracking": {"backends": ["csv"], "dir": str(tmp_path), "run_name": "eval"}}
    run = live_run(config)
    task = FunctionTask(PROMPTS, even_length_reward, name="even")
    n = 4
    report = run.evaluate(task, samples=n, k=(1, 2), seed=5, max_new_tokens=6, temperature=1.0)
    again = run.evaluate(task, samples=n, k=(1, 2), seed=5, max_new_tokens=6, temperature=1.0, log=False)
    greedy = run.generate(PROMPTS, do_sample=False, num_return_sequences=1, max_new_tokens=6)
    sampled = run.generate(PROMPTS, do_sample=True, num_return_sequences=n, seed=5, max_new_tokens=6,
                           temperature=1.0)
    assert run.close() == 0

    assert again == report
    for row, g, s, prompt in zip(report["per_prompt"], greedy, sampled, PROMPTS):
        assert row["greedy"] == even_length_reward(prompt, g[0]["text"])
        assert row["sampled"] == [even_length_reward(prompt, out["text"]) for out in s]
    passes = [round(sum(row["sampled"])) for row in report["per_prompt"]]
    by_hand = [1 - math.comb(n - c, 2) / math.comb(n, 2) if n - c >= 2 else 1.0 for c in passes]
    assert report["sampled"]["pass@2"]["value"] == pytest.approx(sum(by_hand) / len(by_hand))
    assert report["greedy"]["pass@1"]["value"] == pytest.approx(
        sum(row["greedy"] for row in report["per_prompt"]) / len(PROMPTS))
    with open(tmp_path / "eval" / "scalars.csv") as f:
        rows = {r["key"]: float(r["value"]) for r in csv.DictReader(f)}
    assert rows["eval/even/sampled/pass@2"] == pytest.approx(report["sampled"]["pass@2"]["value"])
    assert rows["eval/even/greedy/mean_reward"] == pytest.approx(report["greedy"]["mean_reward"]["value"])
