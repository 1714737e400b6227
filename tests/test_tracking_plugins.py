"""Tracking back ends as plugins: the registry is the one source of their names (the config's checks, the Caller's
calls, the install hints), pyproject.toml declares the built-ins in the entry-point group ``llmrl.trackers``, and a
third party adds a back end with one class named in its package's entry points, which a config may then name and
the Caller's tracker writes through."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from llmrl.engine.client.tracking import TrackerBackend, registry
from llmrl.engine.client.tracking.protocol import contract_problem
from llmrl.engine.config import TrackingConfig, load_config
from llmrl.engine.config.loading import tracking_config
from llmrl.engine.errors import ConfigError, InvalidArgument, PluginError
from testkit.distributions import write_distribution

ROOT = Path(__file__).resolve().parents[1]


def make_tracker_distribution(root: Path) -> Path:
    """A package that registers the ``memory`` back end (and a broken one) through entry points."""
    write_distribution(root, "fake-llmrl-trackers", """
        [llmrl.trackers]
        memory = fake_llmrl_tracker:MemoryBackend
        no_methods = fake_llmrl_tracker:NoMethods
        csv = fake_llmrl_tracker:MemoryBackend
    """)
    (root / "fake_llmrl_tracker.py").write_text(textwrap.dedent("""
        RUNS = []

        class MemoryBackend:
            def __init__(self, run_dir, project, run_name, config, **_):
                self.run = {"dir": run_dir, "project": project, "name": run_name, "config": config,
                            "rows": [], "closed": False}
                RUNS.append(self.run)

            def write(self, scalars, step, wall_time):
                self.run["rows"].append((step, dict(scalars)))

            def close(self):
                self.run["closed"] = True

        class NoMethods:
            pass
    """))
    return root


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    make_tracker_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("fake_llmrl_tracker", None)
    yield tmp_path
    sys.modules.pop("fake_llmrl_tracker", None)


def test_pyproject_declares_exactly_the_built_in_table():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][registry.GROUP]
    assert declared == {info.name: info.target for info in registry.BUILTIN}
    for info in registry.BUILTIN:
        cls = registry.backend_class(info.name) if info.package is None else None
        assert cls is None or isinstance(cls, type) and contract_problem(info.name, cls) is None


def test_built_in_names_and_hints_come_from_the_registry():
    assert registry.names()[:5] == ("csv", "tensorboard", "trackio", "wandb", "mlflow")
    assert registry.requirement("csv") is None
    assert registry.requirement("mlflow")[0] == "mlflow"
    assert "tracking-all" in registry.requirement("mlflow")[1]
    problems = registry.name_problems(["csv", "tensorbord", 3])
    assert problems == [("tracking.backends.1", registry.unknown_message("tensorbord"))]
    assert "(did you mean 'tensorboard'?)" in problems[0][1] and "llmrl.trackers" in problems[0][1]
    with pytest.raises(InvalidArgument, match=r"tracking back end \"nope\" is not one of \"csv\""):
        registry.backend_class("nope")


def test_a_third_party_back_end_validates_and_the_caller_tracker_writes_through_it(third_party, tiny):
    assert "memory" in registry.names() and registry.available()["memory"].provider == "fake-llmrl-trackers 1.0"
    assert registry.available()["csv"].provider == "llmrl"  # a built-in name stays the built-in
    config = load_config(raw={"llms": {"main": {"model": tiny["llama"]}},
                              "tracking": {"backends": ["memory", "csv"], "dir": str(third_party / "runs"),
                                           "run_name": "r1", "project": "p"}})
    assert config.tracking.backends == ("memory", "csv")
    assert tracking_config(config.tracking, "memory").backends == ("memory",)
    with pytest.raises(ConfigError, match=r"tracking.backends.0: \"memroy\" is not one of \"csv\", \"tensorboard\", "
                                          r"\"trackio\", \"wandb\", \"mlflow\", \"memory\", \"no_methods\" "
                                          r"\(did you mean 'memory'\?\)"):
        load_config(raw={"llms": {"main": {"model": tiny["llama"]}}, "tracking": {"backends": ["memroy"]}})

    from llmrl.engine.client.tracking_calls import start_tracker

    tracker = start_tracker(config, None)  # what Caller() runs on rank 0, without a launch
    tracker.log({"reward": {"mean": 0.5}})
    tracker.log_update("main", [{"loss": 2.0}, {"loss": 4.0}], samples=None, seconds=1.0)
    tracker.close()

    import fake_llmrl_tracker

    run = fake_llmrl_tracker.RUNS[-1]
    assert isinstance(fake_llmrl_tracker.MemoryBackend.__new__(fake_llmrl_tracker.MemoryBackend), TrackerBackend)
    assert (run["dir"], run["project"], run["name"]) == (third_party / "runs" / "r1", "p", "r1")
    assert run["config"]["tracking/project"] == "p" and run["closed"]
    assert run["rows"] == [(0, {"reward/mean": 0.5}),
                           (1, {"update/loss": 3.0, "update/replicas": 2.0, "update/seconds": 1.0})]
    assert (third_party / "runs" / "r1" / "scalars.csv").exists()  # the built-in csv, beside it


def test_a_back_end_breaking_the_contract_is_refused_naming_it(third_party, tmp_path):
    from llmrl.engine.client.tracking import Tracker

    tracker = Tracker(TrackingConfig(backends=("no_methods",), dir=str(tmp_path), run_name="r"), ["main"])
    with pytest.raises(PluginError, match=r"tracking back end 'no_methods' \(fake_llmrl_tracker.NoMethods\) has no "
                                          r"write or close method"):
        tracker.log({"x": 1.0})
    tracker.close()
    with pytest.raises(InvalidArgument, match=r"unknown tracking back end 'memroy' \(did you mean 'memory'\?\)"):
        Tracker(TrackingConfig(backends=("memroy",), dir=str(tmp_path)), ["main"])
