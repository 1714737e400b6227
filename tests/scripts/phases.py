"""A client script for interruption tests: marks each phase with a file (``MARKS.<phase>``), then waits in the
phase the test asked for: ``loading`` / ``set-up`` (inside Caller(), while the servers load or build their
engines), ``mid-call`` (inside a call that takes a minute) or ``idle`` (between calls)."""

import os
import sys
import time

from llmrl import Caller


def mark(name: str) -> None:
    with open(f"{sys.argv[1]}.{name}", "w") as f:
        f.write(str(os.getpid()))


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
