"""A client script for interruption tests: marks each phase with a file (``MARKS.<phase>``), then waits in the
phase the test asked for: ``loading`` / ``set-up`` (inside Caller(), while the servers load or build their
engines), ``mid-call`` (inside a call that takes a minute) or ``idle`` (between calls)."""

import os
import sys
import time

from llmrl import Caller


def mark(name: str) -> None:
    """Written whole, then renamed into place: the test sees the file only once it holds the pid."""
    path = f"{sys.argv[1]}.{name}"
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    phase = sys.argv[2]
    mark("started")
    with Caller() as caller:
        mark("ready")
        if phase == "mid-call":
            mark("calling")
            caller.custom_module_fns(["slow"], ["a context"])
        mark("idle")
        while True:
            time.sleep(0.1)
