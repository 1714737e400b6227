"""Run the DeepSpeed launcher as a supervised child: its own session, signals forwarded, nothing left behind.

``llmrl run`` starts the launcher in a new session (its own process group), so a terminal's Ctrl-C reaches
``llmrl run`` alone; it forwards SIGINT or SIGTERM to the launcher's whole group, gives the run ``grace``
seconds to stop by itself, then kills what is left. The launcher is asked to die with ``llmrl run``
(``PR_SET_PDEATHSIG``), and every rank watches ``llmrl run`` and its own launchers
(:func:`llmrl.engine.processes.watch_launchers`), so even a SIGKILL of ``llmrl run`` or of the DeepSpeed runner
ends the run. When the launcher exits, whatever is left of its group (a rank orphaned by a killed runner)
is killed; so is what is still running ``linger`` seconds after the script ended (rank 0 reported its exit code
and its process is gone): the client stopped the servers first, so a rank left is frozen or stuck in a request.

This module starts and stops processes; it does not build the command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def _die_with_parent() -> None:  # runs in the child, before exec
    from llmrl.engine.processes import exit_with_parent

    exit_with_parent(signal.SIGTERM)


def supervise(cmd: list[str], env: dict, grace: float = 5.0, script_ended: Callable[[], bool] | None = None,
              linger: float = 10.0, servers_unreached: Callable[[], bool] | None = None) -> tuple[int, int | None]:
    """Run ``cmd``; returns (its exit code, the signal that asked the run to stop, or None).

    ``script_ended`` tells when rank 0 has reported its exit and its process has ended: the client stops the
    servers before it reports, so a rank still running ``linger`` seconds later is frozen or stuck (the DeepSpeed
    launcher would wait for it forever); the run's group is then killed. When ``servers_unreached()`` says the
    script ended before some servers had connected (a script's ``--help``), those have nothing to finish and
    could not be told to stop: the group is killed at once, without a word."""
    received: list[int] = []
    process = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, frame):
        received.append(signum)
        _signal_group(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        deadline, ended = None, False
        while True:
            try:
                code = process.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + grace
            if deadline is None and script_ended is not None and script_ended():
                early = servers_unreached is not None and servers_unreached()
                deadline = time.monotonic() + (0.0 if early else linger)
                ended = not early
            if deadline is not None and time.monotonic() > deadline:
                if ended:
                    print(f"llmrl: ranks still ran {linger:g} s after the script ended and the servers were told to "
                          "stop (frozen, or stuck in a request); killing them", file=sys.stderr, flush=True)
                    ended = False
                _signal_group(process.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _signal_group(process.pid, signal.SIGKILL)  # orphans of a launcher that died before its ranks
    return code, (received[0] if received else None)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
