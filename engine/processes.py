"""Process helpers every rank needs: die with the launchers, turn a script's exit into a code, leave at once.

This module knows nothing about requests or models.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn


def exit_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent (the launcher) dies: no orphans."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_code(code) -> int:
    """The process exit code for ``sys.exit(code)``: ints as they are, None as 0, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave(code: int, run_atexit: bool = False) -> NoReturn:
    """Exit now without running C++ destructors (process groups, store clients, DeepSpeed's threads): they may
    join threads that wait on peers that have already exited, or destroy a still-joinable thread, which aborts
    the process ("terminate called without an active exception", exit 134). The OS closes every socket.
    With ``run_atexit`` the Python ``atexit`` handlers run first (the user's script may have registered some:
    a logger's flush, an experiment tracker's finish)."""
    if run_atexit:
        import atexit

        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RUN_PID_ENV = "LLMRL_RUN_PID"  # set by `llmrl run`: the process the user started


def watch_launchers(on_gone: Callable[[str], None], environ=os.environ, interval: float = 0.5) -> list[int]:
    """Call ``on_gone(why)`` (once, from a daemon thread) when a process that launched this rank ends: DeepSpeed's
    per-node launcher (the parent), the runner that started it (the grandparent) and ``llmrl run`` itself
    (``LLMRL_RUN_PID``, watched only if it is an ancestor: a stale value in a shell's environment is ignored).
    Killing any of them, even with SIGKILL, then ends every rank of the run. Returns the pids watched."""
    import psutil

    watched: list = []
    try:
        me = psutil.Process()
        ancestors = me.parents()
        watched = [p for p in ancestors[:2] if p.pid > 1]
        run_pid = environ.get(RUN_PID_ENV, "")
        if run_pid.isdigit() and all(p.pid != int(run_pid) for p in watched):
            watched += [p for p in ancestors if p.pid == int(run_pid)]
    except psutil.Error:
        pass

    names = {p.pid: _name(p) for p in watched}

    def loop() -> None:
        while True:
            for process in watched:
                try:
                    gone = not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    gone = True
                if gone:
                    on_gone(f"its launcher process {process.pid} ({names[process.pid]}) ended")
                    return
            time.sleep(interval)

    if watched:
        threading.Thread(target=loop, name="llmrl-watch-launchers", daemon=True).start()
    return [p.pid for p in watched]


def _name(process) -> str:
    try:
        return " ".join(process.cmdline()[:3]) or process.name()
    except Exception:  # noqa: BLE001 - a process that is gone has no name left
        return "?"
