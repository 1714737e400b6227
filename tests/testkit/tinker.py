"""``llmrl tinker`` in a child process, for the tests that drive it through the ``tinker`` SDK or the cookbook.

:func:`start_tinker` writes the config, starts the service and returns once it answers: the event is the ready file
the service writes when it serves (polled while the process is alive; the limit only guards against a start-up that
hangs, as :class:`~testkit.live.LiveRun`'s does). :func:`stop_tinker` sends Ctrl-C and checks the run ends with 130.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml


def start_tinker(config: dict, folder: Path, key: str, startup_timeout: float = 300.0) -> dict:
    """``{"url", "process", "folder"}`` of a service started from ``config`` in ``folder``."""
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    ready, log = folder / "url", folder / "service.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "llmrl.launch.cli", "tinker", "--config", str(folder / "config.yaml"), "--port", "0",
         "--api-key", key, "--ready-file", str(ready), "--save-dir", str(folder / "saved")],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    deadline = time.monotonic() + startup_timeout
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            raise RuntimeError(f"llmrl tinker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return {"url": ready.read_text(), "process": process, "folder": folder}


def stop_tinker(service: dict, timeout: float = 120.0) -> None:
    """Ctrl-C to the service's process group; it must end with 130 (as a run stopped by Ctrl-C does)."""
    os.killpg(service["process"].pid, signal.SIGINT)
    code = service["process"].wait(timeout)
    assert code == 130, (service["folder"] / "service.log").read_text()[-3000:]
