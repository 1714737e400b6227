"""A rank exits when the `llmrl run` command above it is killed outright (SIGKILL), and watches nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from llmrl.launch.lifeline import RUN_PID_VARIABLE, watch_run_command

RANK = textwrap.dedent("""
    import os, sys, threading
    from llmrl.launch.lifeline import watch_run_command
    watched = watch_run_command()
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {watched}")
    threading.Event().wait()
""")
# Stands for `llmrl run`: starts the "rank" with its own pid in LLMRL_RUN_PID, then waits forever.
COMMAND = textwrap.dedent("""
    import os, subprocess, sys, threading
    env = {**os.environ, "LLMRL_RUN_PID": str(os.getpid())}
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, stderr=open(sys.argv[3], "w"))
    threading.Event().wait()
""")


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_rank_exits_when_the_run_command_is_killed(tmp_path):
    ready, log = tmp_path / "ready", tmp_path / "rank.log"
    command = subprocess.Popen([sys.executable, "-c", COMMAND, RANK, str(ready), str(log)])
    try:
        wait_until(lambda: ready.exists() and ready.read_text())
        rank_pid, watched = ready.read_text().split()
        assert watched == str(command.pid)
        rank = psutil.Process(int(rank_pid))
        assert rank.is_running()
        command.send_signal(signal.SIGKILL)
        command.wait(30)
        wait_until(lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE)
        assert f"the `llmrl run` command of this node (pid {command.pid}) is gone" in log.read_text()
    finally:
        command.kill()
        command.wait(30)


def test_only_an_ancestor_is_watched():
    def never(pid):
        raise AssertionError("must not be called")

    assert watch_run_command({}, on_gone=never) is None
    assert watch_run_command({RUN_PID_VARIABLE: "x"}, on_gone=never) is None
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a live process that is not an ancestor (a stale or foreign pid)
        assert watch_run_command({RUN_PID_VARIABLE: str(other.pid)}, on_gone=never) is None
    finally:
        other.kill()
        other.wait()
    assert watch_run_command({RUN_PID_VARIABLE: str(os.getppid())}, on_gone=never) == os.getppid()
