"""Process helpers every rank needs: die with the launcher, turn a script's exit into a code, leave at once.

This module knows nothing about requests or models.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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


def leave(code: int) -> NoReturn:
    """Exit now without running C++ destructors (process groups, store clients, DeepSpeed's threads): they may
    join threads that wait on peers that have already exited. The OS closes every socket."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
