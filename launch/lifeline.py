"""A rank's lifeline to the ``llmrl run`` command of its node: when that command dies, the rank exits.

Each rank already asks Linux to kill it when its parent, DeepSpeed's per-node launcher, dies
(``PR_SET_PDEATHSIG``). That does not cover the commands above it: if ``llmrl run`` (or the
``deepspeed`` command it starts) is killed outright (SIGKILL, the OOM killer, a batch system ending
the step), the per-node launcher is orphaned and the ranks go on running. ``llmrl run`` therefore
puts its pid in ``LLMRL_RUN_PID``; every rank that descends from that process watches it through a
pidfd (the kernel wakes the watcher when the process exits; no polling) and exits with code 1 when it
is gone. The DeepSpeed launcher then sees its ranks fail and exits too.

Not covered: runs started with the raw ``deepspeed --module llmrl.launch`` form (no ``llmrl run``
above them), and systems without ``os.pidfd_open`` (Linux before 5.3, other operating systems).
"""

from __future__ import annotations

import os
import sys
import threading

RUN_PID_VARIABLE = "LLMRL_RUN_PID"


def is_ancestor(pid: int, of: int | None = None) -> bool:
    """Whether process ``pid`` is an ancestor of process ``of`` (default: this process)."""
    import psutil

    try:
        return any(parent.pid == pid for parent in psutil.Process(of or os.getpid()).parents())
    except psutil.Error:
        return False


def _gone(pid: int) -> None:
    print(f"llmrl: the `llmrl run` command of this node (pid {pid}) is gone; this rank (pid {os.getpid()}) exits",
          file=sys.stderr, flush=True)
    os._exit(1)


def watch_run_command(environ=os.environ, on_gone=_gone) -> int | None:
    """Start watching the ``llmrl run`` process named by ``LLMRL_RUN_PID``; call ``on_gone(pid)`` (from a
    daemon thread) when it exits. Returns the pid watched, or None when there is none to watch (the
    variable is unset, or names a process that is not an ancestor of this one)."""
    text = environ.get(RUN_PID_VARIABLE, "")
    if not text.isdigit() or not hasattr(os, "pidfd_open"):
        return None
    pid = int(text)
    if not is_ancestor(pid):
        return None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # it died between the check and now
        on_gone(pid)
        return pid
    except OSError:
        return None

    def wait() -> None:
        import select

        select.select([fd], [], [])
        on_gone(pid)

    threading.Thread(target=wait, name="llmrl-lifeline", daemon=True).start()
    return pid
