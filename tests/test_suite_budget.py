"""The suite's budget (:mod:`testkit.budget`): one test over a minute fails the run, the total never does, and the
summary names the 15 slowest tests and the total. Checked on hand-made durations, not on this run's."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest

from testkit import budget


def test_one_test_over_a_minute_is_named_and_fails_the_run(monkeypatch):
    assert budget.over_the_limit({"a": 61.0, "b": 59.9, "c": 75.0}) == [("c", 75.0), ("a", 61.0)]
    assert budget.over_the_limit({"a": 60.0}) == []  # up to the minute itself is within the budget
    monkeypatch.setattr(budget, "_durations", collections.Counter({"slow": 61.0, "quick": 0.1}))
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    budget.pytest_sessionfinish(session, pytest.ExitCode.OK)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED


def test_a_long_total_of_short_tests_passes(monkeypatch):
    monkeypatch.setattr(budget, "_durations", collections.Counter({f"t{i}": 59.0 for i in range(100)}))
    session = SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    budget.pytest_sessionfinish(session, pytest.ExitCode.OK)
    assert session.exitstatus == pytest.ExitCode.OK


def test_the_summary_lists_the_fifteen_slowest_and_the_total():
    lines = budget.summary({f"t{i}": float(i) for i in range(20)})
    assert len(lines) == 16
    assert [line.split()[-1] for line in lines[:15]] == [f"t{i}" for i in range(19, 4, -1)]
    assert lines[-1].startswith("total of 20 tests: 190.0 s")


def test_files_are_ranked_by_the_sum_of_their_tests():
    lines = budget.by_file({"tests/a.py::x": 5.0, "tests/a.py::y[1]": 4.0, "tests/b.py::z": 8.0, "tests/c.py::w": 1.0},
                           shown=2)
    assert lines == ["    9.0 s  tests/a.py (2 tests)", "    8.0 s  tests/b.py (1 test)"]


def test_a_budget_marker_gives_one_test_its_own_limit_and_needs_a_reason():
    durations = {"compile": 75.0, "other": 75.0}
    assert budget.over_the_limit(durations, limits={"compile": 120.0}) == [("other", 75.0)]
    assert budget.over_the_limit({"compile": 121.0}, limits={"compile": 120.0}) == [("compile", 121.0)]
    marked = SimpleNamespace(nodeid="t", user_properties=[],
                             get_closest_marker=lambda name: SimpleNamespace(args=(120,), kwargs={"why": "a compile"}))
    budget.pytest_collection_modifyitems([marked])
    assert marked.user_properties == [("budget_seconds", 120.0)]
    for args, kwargs in (((120,), {}), ((500,), {"why": "long"}), ((30,), {"why": "short"})):
        bad = SimpleNamespace(nodeid="t", user_properties=[],
                              get_closest_marker=lambda name, a=args, k=kwargs: SimpleNamespace(args=a, kwargs=k))
        with pytest.raises(pytest.UsageError, match="needs a reason"):
            budget.pytest_collection_modifyitems([bad])
