"""The suite's time budget, a pytest plugin loaded by ``tests/conftest.py``: at the end of a run it prints the 15
slowest tests, the 15 slowest files and the total of all tests' times, and it fails the run when one test took
longer than :data:`LIMIT_SECONDS` (its set-up, call and tear-down together, module-scoped fixtures included where
pytest counts them: in the set-up of the module's first test).

A test whose subject is itself long (a ``torch.compile`` of the decode step, which on 2 shared cores takes most
of a minute per rank) carries ``@pytest.mark.budget(seconds, why="...")``: its own limit, at most
:data:`MOST_SECONDS`, with the reason written beside it.

It never fails on the total: on a shared machine the total moves with the machine's load, while one test of over a
minute is a test that should share a live run, or be split. With pytest-xdist the reports reach the controlling
process, which does the counting. It times nothing itself; it reads pytest's own durations.
"""

from __future__ import annotations

import collections
import os

import pytest

LIMIT_SECONDS = 60.0
MOST_SECONDS = 150.0  # the most a budget marker may give one test
SHOWN = 15

_durations: collections.Counter = collections.Counter()  # node id -> seconds, set-up + call + tear-down
_limits: dict[str, float] = {}  # node id -> its own limit (a budget marker)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "budget(seconds, why): this test's own time limit (at most 150 s), with the "
                                       "reason its subject takes that long")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        marker = item.get_closest_marker("budget")
        if marker is None:
            continue
        seconds, why = float(marker.args[0]), marker.kwargs.get("why", "")
        if not why or not LIMIT_SECONDS < seconds <= MOST_SECONDS:
            raise pytest.UsageError(f"{item.nodeid}: budget(seconds, why=...) needs a reason and {LIMIT_SECONDS:.0f} < "
                                    f"seconds <= {MOST_SECONDS:.0f}, got {seconds:g} and {why!r}")
        item.user_properties.append(("budget_seconds", seconds))  # travels to pytest-xdist's controller


def _controller() -> bool:
    """Whether this process counts: the only process of a plain run, or pytest-xdist's controller (not a worker)."""
    return "PYTEST_XDIST_WORKER" not in os.environ


def pytest_runtest_logreport(report) -> None:
    if _controller():
        _durations[report.nodeid] += report.duration
        for key, value in report.user_properties:
            if key == "budget_seconds":
                _limits[report.nodeid] = float(value)


def over_the_limit(durations: dict[str, float], limit: float = LIMIT_SECONDS,
                   limits: dict[str, float] | None = None) -> list[tuple[str, float]]:
    """The tests that took longer than their limit (``limits``' entry, else ``limit`` seconds), slowest first."""
    limits = _limits if limits is None else limits
    return sorted(((n, t) for n, t in durations.items() if t > limits.get(n, limit)), key=lambda item: -item[1])


def summary(durations: dict[str, float], shown: int = SHOWN) -> list[str]:
    """The lines printed at the end of a run: the ``shown`` slowest tests and the total."""
    slowest = sorted(durations.items(), key=lambda item: -item[1])[:shown]
    lines = [f"{seconds:7.1f} s  {nodeid}" for nodeid, seconds in slowest]
    lines.append(f"total of {len(durations)} tests: {sum(durations.values()):.1f} s (summed over pytest-xdist's "
                 "workers, which run side by side)")
    return lines


def by_file(durations: dict[str, float], shown: int = SHOWN) -> list[str]:
    """The ``shown`` files whose tests took longest in all, with their number of tests: where a live run shared
    by more tests, or a merged launch, would pay most."""
    files: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for nodeid, seconds in durations.items():
        path = nodeid.split("::", 1)[0]
        files[path] += seconds
        counts[path] += 1
    return [f"{seconds:7.1f} s  {path} ({counts[path]} test{'s' * (counts[path] != 1)})"
            for path, seconds in files.most_common(shown)]


def pytest_terminal_summary(terminalreporter) -> None:
    if not _durations:
        return
    terminalreporter.write_sep("=", f"suite budget: the {SHOWN} slowest tests")
    for line in summary(_durations):
        terminalreporter.write_line(line)
    terminalreporter.write_sep("-", f"the {SHOWN} slowest files")
    for line in by_file(_durations):
        terminalreporter.write_line(line)
    for nodeid, seconds in over_the_limit(_durations):
        limit = _limits.get(nodeid, LIMIT_SECONDS)
        terminalreporter.write_line(f"over the budget: {nodeid} took {seconds:.1f} s, more than {limit:.0f} s for "
                                    "this test; share a live run with its neighbours, or split it", red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if over_the_limit(_durations) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
