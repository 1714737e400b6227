"""Experiment tracking without a run: scalars written through :class:`~llmrl.engine.client.tracking.Tracker` are read
back with each tool's own reader (TensorBoard's EventAccumulator, the csv module and pandas, MLflow's client,
trackio's storage, and W&B's offline run file decoded record by record) and compared to the values given; the
reductions (replicas' means, the servers' figures) against hand-computed values; the ``tracking`` config section and
``Caller(tracking=...)`` checked with errors that name the field. (Live: ``test_tracking_live``.)"""

from __future__ import annotations

import csv
import glob
import json
import struct

import pytest

from llmrl.engine.client.tracking import Tracker
from llmrl.engine.client.tracking.scalars import flatten, server_scalars, server_totals, update_scalars
from llmrl.engine.config import TrackingConfig, load_config
from llmrl.engine.config.loading import tracking_config
from llmrl.engine.errors import ConfigError, InvalidArgument, InvalidArgumentType

REPLICAS = [{"loss": 1.0, "lr": 0.01, "replica": 0, "indices": [0, 1], "note": "x", "kl": {"mean": 0.5}},
            {"loss": 3.0, "lr": 0.01, "replica": 1, "indices": [2], "note": "y", "kl": {"mean": 1.5}, "only": 7}]


def tracker(tmp_path, *backends, llms=("main",), **settings) -> Tracker:
    return Tracker(TrackingConfig(backends=tuple(backends), dir=str(tmp_path), run_name="r1", **settings),
                   list(llms), {"seed": 0, "llms/main/model": "tiny"})


def csv_rows(path) -> list[tuple[int, str, float]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [(int(r["step"]), r["key"], float(r["value"])) for r in rows]


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_update_statistics_are_the_replicas_means():
    out = update_scalars(REPLICAS, samples=3, seconds=0.5)
    assert out == {"loss": 2.0, "lr": 0.01, "replica": 0.5, "kl/mean": 1.0, "only": 7.0, "replicas": 2.0,
                   "seconds": 0.5, "samples": 3.0, "samples_per_second": 6.0}  # lists and strings left out
    one = update_scalars({"optimizer_steps": 1, "grad_norm": None, "adapters": ["default"]}, None, 2.0)
    assert one == {"optimizer_steps": 1.0, "replicas": 1.0, "seconds": 2.0}  # optim_step's single dict


def test_server_figures_per_llm_with_the_cache_hit_rate_between_reports():
    mb = 1 << 20
    llm_of = {1: "policy", 2: "policy", 3: "reward"}

    def report(hits1, looked1, hits2, looked2, scores):
        return {1: {"rss": 100 * mb, "peak_rss": 150 * mb, "kv_cache": {"bytes": 2 * mb, "hit_tokens": hits1,
                                                                        "lookup_tokens": looked1},
                    "requests": {"score": scores, "stats": 40}},
                2: {"rss": 120 * mb, "peak_rss": 130 * mb, "kv_cache": {"bytes": 3 * mb, "hit_tokens": hits2,
                                                                        "lookup_tokens": looked2},
                    "requests": {"score": scores - 1, "update": 1}},
                3: {"rss": 50 * mb, "peak_rss": 60 * mb, "cuda_allocated": 10 * mb, "requests": {}}}

    first = server_totals(report(30, 100, 10, 100, 5), llm_of)
    assert server_scalars(first, None, None) == {
        "policy": {"rss_mb": 120.0, "peak_rss_mb": 150.0, "kv_cache_mb": 3.0, "kv_cache_hit_rate": 0.2},
        "reward": {"rss_mb": 50.0, "peak_rss_mb": 60.0, "cuda_allocated_mb": 10.0}}
    second = server_totals(report(90, 200, 10, 150, 25), llm_of)
    policy = server_scalars(second, first, 4.0)["policy"]
    assert policy["kv_cache_hit_rate"] == 60 / 150  # since the first report: 60 more hits in 150 more tokens
    assert policy["requests_per_second"] == (25 - 5) / 4.0  # the busiest rank's requests, stats left out
    assert "kv_cache_hit_rate" not in server_scalars(second, second, 1.0)["policy"]  # nothing looked up since


def test_script_metrics_are_checked_and_flattened():
    import numpy as np
    import torch

    assert flatten({"reward": np.float32(0.5), "eval": {"success": torch.tensor(0.25), "n": 8}, "done": True}) == {
        "reward": 0.5, "eval/success": 0.25, "eval/n": 8.0, "done": 1.0}
    with pytest.raises(InvalidArgumentType, match="metric 'eval/text' must be a number"):
        flatten({"eval": {"text": "high"}})
    with pytest.raises(InvalidArgumentType, match="metric 'rewards' must be a number .* got Tensor"):
        flatten({"rewards": torch.ones(3)})
    with pytest.raises(InvalidArgumentType, match="metric names must be non-empty strings, got 3"):
        flatten({3: 1.0})
    with pytest.raises(InvalidArgumentType, match="metrics must be a dict"):
        flatten([("reward", 1.0)])


def test_csv_and_tensorboard_read_back(tmp_path):
    import pandas as pd

    track = tracker(tmp_path, "csv", "tensorboard")
    track.log({"reward": 0.25, "eval": {"success": 0.5}})  # before any update: step 0
    calls = []

    def servers():
        calls.append(1)
        return {1: {"rss": 3 << 20, "kv_cache": {"bytes": 0, "hit_tokens": 1, "lookup_tokens": 4}}}, {1: "main"}

    written = track.log_update("main", REPLICAS, 3, 0.5, servers)
    track.log({"reward": 0.75})  # after the update: its step
    track.log({"reward": 1.0}, step=10)
    track.close()
    assert calls == [1] and track.step == 1
    assert written["update/loss"] == 2.0 and written["server/main/kv_cache_hit_rate"] == 0.25
    run_dir = tmp_path / "r1"
    want = [(0, "reward", 0.25), (0, "eval/success", 0.5), *[(1, k, v) for k, v in written.items()],
            (1, "reward", 0.75), (10, "reward", 1.0)]
    assert csv_rows(run_dir / "scalars.csv") == want
    wide = pd.read_csv(run_dir / "scalars.csv").pivot_table(index="step", columns="key", values="value")
    assert wide.loc[1, "update/loss"] == 2.0 and wide.loc[10, "reward"] == 1.0  # the documented pandas recipe
    scalars = tensorboard_scalars(run_dir)
    assert scalars["reward"] == [(0, 0.25), (1, 0.75), (10, 1.0)]
    assert scalars["eval/success"] == [(0, 0.5)]
    for key, value in written.items():
        assert scalars[key] == [(1, pytest.approx(value, rel=1e-6))], key  # events hold float32
    with pytest.raises(RuntimeError, match="closed"):
        track.log({"reward": 1.0})


def test_names_carry_the_llm_in_runs_of_several_and_csv_appends_to_a_named_run(tmp_path):
    track = tracker(tmp_path, "csv", llms=("policy", "critic"))
    track.log_update("critic", [{"loss": 1.0}], None, 1.0)
    track.close()
    again = tracker(tmp_path, "csv", llms=("policy", "critic"))  # the same run_name: the same file, appended to
    again.log({"reward": 2.0}, step=5)
    again.close()
    assert csv_rows(tmp_path / "r1" / "scalars.csv") == [
        (1, "update/critic/loss", 1.0), (1, "update/critic/replicas", 1.0), (1, "update/critic/seconds", 1.0),
        (5, "reward", 2.0)]


def test_default_run_names_never_reuse_a_folder(tmp_path, monkeypatch):
    """Two runs started within one second get the same default name: the second takes another folder."""
    from llmrl.engine.client.tracking import tracker as module

    monkeypatch.setattr(module, "default_run_name", lambda: "script-20261203-101500")  # (both in the same second)
    first = Tracker(TrackingConfig(backends=("csv",), dir=str(tmp_path)), ["main"])
    first.log({"a": 1.0})
    second = Tracker(TrackingConfig(backends=("csv",), dir=str(tmp_path)), ["main"])
    assert second.run_dir != first.run_dir and second.run_name.startswith(first.run_name)
    for track in (first, second):
        track.close()


def test_without_backends_nothing_is_written_or_asked(tmp_path):
    track = tracker(tmp_path)
    track.log({"reward": 1.0})
    track.log_update("main", REPLICAS, 3, 1.0, lambda: pytest.fail("no back end: no stats round trip"))
    track.close()
    assert list(tmp_path.iterdir()) == []


def test_server_stats_every(tmp_path):
    calls = []
    track = tracker(tmp_path, "csv", server_stats_every=2)
    for _ in range(5):
        track.log_update("main", [{"loss": 1.0}], None, 1.0, lambda: calls.append(1) or ({}, {}))
    track.close()
    assert len(calls) == 2  # after updates 2 and 4


def test_a_call_may_name_other_backends(tmp_path):
    track = tracker(tmp_path, "csv")
    track.log({"reward": 1.0}, backends=["tensorboard"])  # opened for this run on demand
    with pytest.raises(InvalidArgument, match=r"unknown tracking back end 'tensorbord' \(did you mean "
                                              r"'tensorboard'\?\); the back ends are csv, tensorboard, trackio"):
        track.log({"reward": 1.0}, backends=["tensorbord"])
    with pytest.raises(InvalidArgument, match="step must be >= 0"):
        track.log({"reward": 1.0}, step=-1)
    track.close()
    assert tensorboard_scalars(tmp_path / "r1") == {"reward": [(0, 1.0)]}
    assert not (tmp_path / "r1" / "scalars.csv").exists()  # never written to: never opened


def test_mlflow_file_store_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="setup.sh leaves MLflow out (pyproject.toml says why): pip install -e "
                                         "'.[tracking-all]' runs this test")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient

    track = tracker(tmp_path, "mlflow", project="proj")
    track.log({"reward": 0.5, "loss:sum": 2.0})
    track.log_update("main", [{"loss": 1.5}], 4, 2.0)
    track.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params["llms/main/model"] == "tiny"

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    assert history("reward") == [(0, 0.5)]
    assert history("loss:sum") == [(0, 2.0)]
    assert history("update/loss") == [(1, 1.5)] and history("update/samples_per_second") == [(1, 2.0)]


def wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file: a LevelDB-style log (32 KiB blocks of records, each with a
    7-byte header: CRC, length, type) after a 7-byte W&B header, each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending = (b"" if kind in (1, 2) else pending) + data[pos + 7:pos + 7 + length]  # full/first start anew
        pos += 7 + length
        if kind in (1, 4):  # full, last
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    track = tracker(tmp_path, "wandb")
    track.log({"reward": 0.5})
    track.log_update("main", REPLICAS, 3, 0.5)
    track.log({"reward": 0.25}, step=0)  # a step back is kept (plotted against the llmrl step)
    track.close()
    import wandb

    wandb.teardown()  # W&B's service writes the run file on its own: it has closed it once stopped
    (path,) = glob.glob(str(tmp_path / "r1" / "wandb" / "offline-run-*" / "run-*.wandb"))  # offline: nothing sent
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in wandb_history(path)]
    update = {f"update/{k}": v for k, v in update_scalars(REPLICAS, 3, 0.5).items()}
    assert rows == [{"reward": 0.5, "step": 0}, {**update, "step": 1}, {"reward": 0.25, "step": 0}]


def test_trackio_read_back(tmp_path, monkeypatch):
    import importlib.util
    import sys

    if importlib.util.find_spec("trackio") is None:  # not importorskip: trackio reads TRACKIO_DIR when imported
        pytest.skip("trackio is not installed")
    fresh = "trackio" not in sys.modules
    if fresh:
        monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    track = tracker(tmp_path, "trackio", project="proj")
    track.log({"reward": 0.5})
    track.log_update("main", [{"loss": 1.5}], None, 2.0)
    track.close()
    from trackio.sqlite_storage import SQLiteStorage

    if fresh:  # the first import of trackio in this process read the folder set here (else: trackio's own)
        assert (tmp_path / "trackio" / "proj.db").exists()
    logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in SQLiteStorage.get_logs("proj", "r1")]
    assert logs == [{"reward": 0.5, "step": 0},
                    {"update/loss": 1.5, "update/replicas": 1.0, "update/seconds": 2.0, "step": 1}]


def test_the_tracking_section_and_its_overrides(tiny):
    base = {"llms": {"main": {"model": tiny["llama"]}}}
    assert load_config(raw=base).tracking == TrackingConfig()  # off unless asked
    config = load_config(raw=base, overrides=["tracking.backends=[csv, tensorboard]", "tracking.dir=/tmp/x",
                                              "tracking.server_stats_every=0"])
    assert config.tracking == TrackingConfig(backends=("csv", "tensorboard"), dir="/tmp/x", server_stats_every=0)
    with pytest.raises(ConfigError) as err:
        load_config(raw=base, overrides=["tracking.backends=[csv, tensorbord]", "tracking.run_name=a/b",
                                         "tracking.backends_=[csv]"])
    text = str(err.value)
    assert ('tracking.backends.1: "tensorbord" is not one of "csv", "tensorboard", "trackio", "wandb", "mlflow" '
            "(did you mean 'tensorboard'?)") in text
    assert "tracking.run_name: 'a/b' is not allowed here: write a name without slashes" in text
    assert "tracking.backends_: unknown key 'backends_' (did you mean 'backends'?)" in text
    with pytest.raises(ConfigError, match=r"tracking.backends: expected array, got str \"csv\"; write a list such "
                                          r"as \[csv, tensorboard\]"):
        load_config(raw=base, overrides=["tracking.backends=csv"])


def test_a_missing_package_is_named_with_its_install(tiny, monkeypatch, tmp_path):
    import importlib.util

    from llmrl.engine.client.tracking import BackendMissing

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking.backends: the wandb back end needs the wandb package, which "
                                          r"is not installed: pip install -e '\.\[tracking-local\]' in llmrl's clone"):
        load_config(raw={"llms": {"main": {"model": tiny["llama"]}}, "tracking": {"backends": ["csv", "wandb"]}})
    with pytest.raises(BackendMissing, match="the wandb back end needs the wandb package"):
        tracker(tmp_path, "wandb")


def test_caller_tracking_argument_replaces_the_config_keys():
    base = TrackingConfig(backends=("csv",), dir="runs/x", project="p")
    assert tracking_config(base, None) == base
    assert tracking_config(base, False) == TrackingConfig(dir="runs/x", project="p")
    assert tracking_config(base, "tensorboard").backends == ("tensorboard",)
    assert tracking_config(base, ["csv", "wandb"]).backends == ("csv", "wandb")
    assert tracking_config(base, {"dir": "out", "run_name": "r"}) == TrackingConfig(
        backends=("csv",), dir="out", run_name="r", project="p")
    with pytest.raises(ValueError, match=r"tracking.backends.0: \"tb\" is not one of \"csv\", \"tensorboard\""):
        tracking_config(base, ["tb"])
    with pytest.raises(ValueError, match="tracking.server_stats_every: must be >= 0, got -1"):
        tracking_config(base, {"server_stats_every": -1})
    with pytest.raises(ValueError, match="tracking: expected a mapping of tracking keys"):
        tracking_config(base, 3)
