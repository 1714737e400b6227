"""A rank ends when any process that launched it ends, even by SIGKILL: DeepSpeed's per-node launcher (its
parent), the runner above that (its grandparent) and ``llmrl run`` (``LLMRL_RUN_PID``, only when it is an
ancestor: a stale pid in a shell's environment is ignored)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from llmrl.engine.processes import watch_launchers

# The "rank": watches its launchers, reports its pid and what it watches, then waits forever.
RANK = textwrap.dedent("""
    import os, sys, threading
    from llmrl.engine.processes import watch_launchers
    def gone(why):
        print(why, flush=True)
        os._exit(1)
    watched = watch_launchers(gone, interval=0.1)
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(map(str, [os.getpid(), *watched])))
    threading.Event().wait()
""")
# A launcher stand-in: starts its child command, writes the child's pid, then waits forever.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, threading
    child = subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1] + ".log", "w"))
    threading.Event().wait()
""")


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_chain(tmp_path):
    """runner -> launcher -> rank, like `deepspeed` -> launch.py -> a rank."""
    ready = tmp_path / "ready"
    rank_cmd = [sys.executable, "-c", RANK, str(ready)]
    launcher_cmd = [sys.executable, "-c", LAUNCHER, str(tmp_path / "launcher"), *rank_cmd]
    runner = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "runner"), *launcher_cmd],
                              start_new_session=True)
    wait_until(lambda: ready.exists() and ready.read_text())
    rank_pid, *watched = map(int, ready.read_text().split())
    launcher_pid = psutil.Process(rank_pid).ppid()
    return runner, launcher_pid, rank_pid, watched


def test_a_rank_ends_when_its_runner_or_its_launcher_is_killed(tmp_path):
    for victim in ("runner", "launcher"):
        folder = tmp_path / victim
        folder.mkdir()
        runner, launcher_pid, rank_pid, watched = start_chain(folder)
        try:
            assert watched == [launcher_pid, runner.pid]
            os.kill(runner.pid if victim == "runner" else launcher_pid, signal.SIGKILL)
            wait_until(lambda pid=rank_pid: ended(pid))
            log = (folder / "launcher.log").read_text()
            assert f"its launcher process {runner.pid if victim == 'runner' else launcher_pid}" in log
        finally:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(30)


def test_the_run_command_is_watched_only_when_it_is_an_ancestor():
    def never(why):
        raise AssertionError("must not be called")

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a live process that is not an ancestor (a stale or foreign pid)
        watched = watch_launchers(never, {"LLMRL_RUN_PID": str(other.pid)})
        assert other.pid not in watched
    finally:
        other.kill()
        other.wait()
    ancestors = [p.pid for p in psutil.Process().parents()]
    if len(ancestors) > 2:  # a great-grandparent named as `llmrl run` is watched too
        assert ancestors[2] in watch_launchers(never, {"LLMRL_RUN_PID": str(ancestors[2])})
