"""``benchmarks.async_grpo --summarize``: the table of a synchronous and an asynchronous run of the in-script GRPO
demo, from their summary.json files (written here by hand): speed-ups are the synchronous run's median seconds per
update over each run's, and the model's bound for separate devices is (sampling + training) / max(both)."""

from __future__ import annotations

import json

import pytest

from benchmarks.async_grpo import summarize


def write_run(folder, staleness: int, seconds: list[float], waited: list[float], name: str = "") -> None:
    run = folder / (name or f"staleness-{staleness}")
    run.mkdir(parents=True)
    history = [{"seconds": s, "waited_for_samples": w, "staleness_max": float(min(staleness, i)),
                "ratio_max": 1.0 + 0.01 * staleness, "kl_sampler_learner": 0.001 * staleness,
                "dropped": i % 2 * staleness}
               for i, (s, w) in enumerate(zip(seconds, waited))]
    (run / "summary.json").write_text(json.dumps({
        "history": history, "wall_seconds": sum(seconds),
        "before": {"mean_reward": 0.2, "ci95": [0.1, 0.3]}, "after": {"mean_reward": 0.8, "ci95": [0.7, 0.9]},
        "provenance": {"commit": "abc1234", "date": "2026-12-03", "hardware": "test"}}))


def test_speed_ups_and_the_separate_device_model_are_computed_from_the_medians(tmp_path):
    write_run(tmp_path, 0, seconds=[6.0, 5.0, 7.0], waited=[2.0, 1.0, 3.0])  # medians 6.0 and 2.0
    write_run(tmp_path, 1, seconds=[4.0, 5.0, 4.5], waited=[0.5, 0.1, 0.2])  # median 4.5
    result = summarize(str(tmp_path), [0, 1])
    rows = result["rows"]
    assert rows[0]["speed_up"] == 1.0 and rows[1]["speed_up"] == pytest.approx(6.0 / 4.5)
    assert rows[1]["staleness_max"] == 1.0 and rows[1]["waited_for_samples"] == 0.2
    assert rows[1]["kl_sampler_learner_mean"] == pytest.approx(0.001)
    assert (rows[0]["dropped_batches"], rows[1]["dropped_batches"]) == (0, 1)  # the second of three updates
    # sampling 2 s + training 4 s per synchronous update: apart, an update takes 4 s, so at most 1.5x
    assert result["model"] == pytest.approx({"sampling_seconds": 2.0, "training_seconds": 4.0,
                                             "speed_up_bound_on_separate_devices": 1.5})


def test_a_run_with_a_sampler_rank_gets_its_own_row_against_the_same_baseline(tmp_path):
    write_run(tmp_path, 0, seconds=[6.0, 5.0, 7.0], waited=[2.0, 1.0, 3.0])
    write_run(tmp_path, 1, seconds=[4.0, 5.0, 4.5], waited=[0.5, 0.1, 0.2])
    write_run(tmp_path, 1, seconds=[3.0, 4.0, 5.0], waited=[0.0, 0.0, 0.3], name="staleness-1-sampler")
    rows = summarize(str(tmp_path), [0, 1], [1])["rows"]
    assert list(rows) == [0, 1, "1+sampler"]
    assert rows["1+sampler"]["speed_up"] == pytest.approx(6.0 / 4.0)  # the synchronous run's median over its own
    assert rows["1+sampler"]["waited_for_samples"] == 0.0
