"""``llmrl tinker`` in a child process, for the tests that drive it through the ``tinker`` SDK or the cookbook.

:func:`start_tinker` writes the config, starts the service and returns once it answers: the event is the line the
service prints when it serves, read from its output as it comes (a timer only kills a start-up that hangs).
:func:`stop_tinker` checks the ready file holds the same URL, sends Ctrl-C and checks the run ends with 130.
:func:`command_lines_holding` lists the processes of the service whose command line shows a string (the key).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml


def start_tinker(config: dict, folder: Path, key: str, startup_timeout: float = 300.0, key_by: str = "file") -> dict:
    """``{"url", "process", "folder"}`` of a service started from ``config`` in ``folder``, given ``key`` by
    ``--api-key-file`` (``key_by="file"``, the documented way) or ``--api-key`` (``"flag"``).

    Waits for the event itself: the service's ``export TINKER_BASE_URL=...`` line, which it prints once it serves,
    read from its output as it comes (or the end of that output, if it died). A timer kills a start-up that hangs;
    the output goes on to ``service.log``.
    """
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    log = folder / "service.log"
    if key_by == "file":
        (folder / "key").touch(mode=0o600)
        (folder / "key").write_text(key + "\n")
    given = ["--api-key-file", str(folder / "key")] if key_by == "file" else ["--api-key", key]
    process = subprocess.Popen(
        [sys.executable, "-m", "llmrl.launch.cli", "tinker", "--config", str(folder / "config.yaml"), "--port", "0",
         *given, "--ready-file", str(folder / "url"), "--save-dir", str(folder / "saved")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=folder)
    guard = threading.Timer(startup_timeout, _kill_group, (process.pid,))  # only a hung start-up meets it
    guard.start()
    url = None
    with open(log, "w") as out:
        for line in process.stdout:  # blocks until the service prints; ends when it exits
            out.write(line)
            out.flush()
            if "export TINKER_BASE_URL=" in line:
                url = line.split("=", 1)[1].strip()
                break
    guard.cancel()
    if url is None:
        _kill_group(process.pid)
        process.wait()
        raise RuntimeError(f"llmrl tinker did not start:\n{log.read_text()[-3000:]}")
    threading.Thread(target=_copy_rest, args=(process.stdout, log), daemon=True).start()  # the pipe never fills
    return {"url": url, "process": process, "folder": folder}


def command_lines_holding(service: dict, text: str) -> dict[int, str]:
    """``{pid: command line}`` of the service's processes (the command and every descendant: the launcher and the
    ranks) whose command line holds ``text``, as any user of the machine reads it in ``/proc/<pid>/cmdline``."""
    import psutil

    top = psutil.Process(service["process"].pid)
    found = {}
    for process in [top, *top.children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if text in line:
            found[process.pid] = line
    return found


def _copy_rest(stream, log: Path) -> None:
    with open(log, "a") as out:
        for line in stream:
            out.write(line)
            out.flush()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def stop_tinker(service: dict, timeout: float = 120.0) -> None:
    """Ctrl-C to the service's process group; it must end with 130 (as a run stopped by Ctrl-C does)."""
    assert (service["folder"] / "url").read_text() == service["url"]  # --ready-file, written after the line
    os.killpg(service["process"].pid, signal.SIGINT)
    code = service["process"].wait(timeout)
    assert code == 130, (service["folder"] / "service.log").read_text()[-3000:]
