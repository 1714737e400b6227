"""A client script for interruption tests: marks each phase with a file (``MARKS.<phase>``), then waits in the
phase the test asked for: ``loading`` / ``set-up`` (inside Caller(), while the servers load or build their
engines), ``mid-call`` (inside a call that takes a minute) or ``idle`` (between calls); or ends normally once the
test writes ``MARKS.go``: ``in-flight`` with a minute-long call to LLM ``main`` still running, or ``ends``."""

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
        if phase == "in-flight":  # the script ends normally with a slow call still running
            caller.custom_module_fns_async(["slow"], ["a context"], llm="main")
            mark("calling")
        else:
            mark("idle")
        while not (phase in ("ends", "in-flight") and os.path.exists(f"{sys.argv[1]}.go")):
            time.sleep(0.1)
