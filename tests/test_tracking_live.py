"""Tracking in a live run (2 replicas): real ``update`` and ``optim_step`` calls through the Caller write the updater's
statistics on their own, and ``caller.log`` the script's scalars; read back from the CSV file and TensorBoard's
events, they equal what the calls returned (the replicas' means) and the servers' own counters read with
``server_memory`` (the independent references). The back ends come from three layers at once: the config
(csv), a command-line override (the folder) and ``Caller(tracking=...)`` (TensorBoard added, the run's name)."""

from __future__ import annotations

import csv

import pytest

pytestmark = pytest.mark.slow

CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "x x x", "In the kitchen you see a fridge."]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" c1", " c2", " c3"],
              [" open fridge", " go north"]]
BATCH = {"actions": [1, 0, 2, 1], "weights": [1.0, -0.5, 0.3, 0.7], "targets": [0.5, -1.0, 0.0, 1.0]}
MB = float(1 << 20)


def test_updates_and_script_scalars_are_written_and_read_back(live_run, tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"llms": {"main": {
        "model": tiny["llama"], "replicas": 2, "kv_cache_mb": 8,
        "heads": {"value": {"plugin": "value", "args": {"hidden": 16}}},
        "updater": {"plugin": "llmrl_test_plugins:ChosenScoreUpdater", "args": {"head": "value"}},
        "training": {"optimizer": {"type": "sgd", "lr": 0.01}, "micro_batch_size": 2}}},
        "threads_per_rank": 1, "tracking": {"backends": ["csv"]}}
    run = live_run(config, overrides=[f"tracking.dir={tmp_path}"],
                   caller_kwargs={"tracking": {"backends": ["csv", "tensorboard"], "run_name": "live"}})
    for _ in range(2):  # the second call reads the contexts the first one cached
        run.score(CONTEXTS, CANDIDATES)
    first = run.update(CONTEXTS, CANDIDATES, **BATCH)
    servers = run.server_memory()  # the servers' counters as the tracker read them after the update
    run.call("log", {"reward": 0.5, "eval": {"success": 0.25}})  # (run.log is the run's output)
    second = run.update(CONTEXTS, CANDIDATES, **BATCH)
    run.call("log", {"reward": 0.75}, step=10)
    step = run.optim_step()  # nothing pending: no optimizer step, still a tracked step
    assert run.close() == 0

    with open(tmp_path / "live" / "scalars.csv") as f:
        rows = {(int(r["step"]), r["key"]): float(r["value"]) for r in csv.DictReader(f)}
    for at, stats in ((1, first), (2, second)):
        assert len(stats) == 2
        for key in ("loss", "micro_steps", "lr", "replica", "optimizer_steps"):
            assert rows[(at, f"update/{key}")] == pytest.approx(sum(s[key] for s in stats) / 2), (at, key)
        assert rows[(at, "update/replica")] == 0.5 and rows[(at, "update/replicas")] == 2
        assert rows[(at, "update/samples")] == len(CONTEXTS) and rows[(at, "update/seconds")] > 0
        assert rows[(at, "update/samples_per_second")] == pytest.approx(len(CONTEXTS) / rows[(at, "update/seconds")])
    assert first[0]["loss"] != first[1]["loss"]  # a mean of two different values
    assert rows[(1, "reward")] == 0.5 and rows[(1, "eval/success")] == 0.25 and rows[(10, "reward")] == 0.75
    assert step["optimizer_steps"] == 0 and rows[(3, "update/optimizer_steps")] == 0

    caches = [reply["kv_cache"] for reply in servers.values()]
    hit_rate = sum(c["hit_tokens"] for c in caches) / sum(c["lookup_tokens"] for c in caches)
    assert hit_rate > 0 and rows[(1, "server/main/kv_cache_hit_rate")] == pytest.approx(hit_rate)
    peak = max(reply["peak_rss"] for reply in servers.values()) / MB
    assert 0 < rows[(1, "server/main/peak_rss_mb")] <= peak  # a peak only grows
    assert rows[(2, "server/main/requests_per_second")] > 0  # the second update, since the first report

    events = EventAccumulator(str(tmp_path / "live"))
    events.Reload()
    written = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    assert written == pytest.approx(rows, rel=1e-6)  # the same scalars at the same steps (events hold float32)
