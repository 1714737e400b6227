"""A fork server for :class:`testkit.LiveRun`: one process per test session imports torch, DeepSpeed, transformers
and llmrl's rank code once (:func:`testkit.ranks.preload`), then forks a fresh :mod:`testkit.ranks` launcher for
each run. Without it every run's launcher imports them again first: about 4 CPU-seconds, on one core, before any
rank starts; the suite starts some forty such runs.

A forked launcher is what ``python -m testkit.ranks ...`` started by :class:`subprocess.Popen` would be: its own
session (``start_new_session``), the run's environment, working folder and log as stdout and stderr, stdin from
``/dev/null``, a fresh interpreter's signal dispositions and unbuffered output; it exits with ``testkit.ranks``'s
code. The server writes each launcher's exit status (``Popen.returncode``'s convention: ``-N`` when killed by signal
N) to a file the test process reads (:class:`ForkedLauncher`).

The interpreter and the libraries read some environment variables when they start or are imported. So a run is
forked only when its environment agrees with the server's in every such variable (:data:`_READ_ON_IMPORT`); any
other run (a test's own ``PYTHONPATH``, say) is started the plain way, and :func:`start` returns None for it. A
forked launcher takes the run's whole environment, and its working folder: it changes to it, and puts it first on
``sys.path`` where ``python -m`` had put the server's (nothing the server preloaded comes from there). The
server's own output goes to ``zygote.log`` beside the first run's log. When the test process ends, the server's
stdin closes: it kills what is left of its launchers' sessions and exits.

Test code, never shipped.
"""

from __future__ import annotations

import collections
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time


class ForkedLauncher:
    """A launcher forked by the server: the part of :class:`subprocess.Popen` that LiveRun and the tests use."""

    def __init__(self, pid: int, status_path: str, server: subprocess.Popen):
        self.pid = pid
        self.returncode = None
        self._status_path = status_path
        self._server = server

    def poll(self):
        if self.returncode is None:
            if os.path.exists(self._status_path):
                with open(self._status_path) as f:
                    self.returncode = int(f.read())
            elif self._server.poll() is not None and not _exists(self.pid):
                self.returncode = 1  # its status was lost with the server (which reaps it) before it was written
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"testkit.ranks (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# What the interpreter and the preloaded libraries read when they start or are imported: a run whose environment
# differs from the server's in one of these is started afresh. Any other variable the run gets as it is (the forked
# launcher takes the run's whole environment), as it would in a fresh process.
_READ_ON_IMPORT = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "TORCH_", "PYTORCH_", "CUDA", "NCCL_", "DS_",
                   "DEEPSPEED", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS")
_SET_BY_TORCH = ("PYTORCH_NVML_BASED_CUDA_CHECK",)  # set in the test process by torch itself once it looked for CUDA


def _read_on_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_READ_ON_IMPORT) and k not in _SET_BY_TORCH}


_ANSWER_TIMEOUT = 300.0  # seconds for the server's answer, its imports included (LiveRun's startup_timeout)
_lock = threading.Lock()
STARTS: collections.Counter = collections.Counter()  # how this process's runs started: forked, or afresh and why
_server: dict | None = None  # {"process", "env"} of this test process's server, once started


def start(argv: list[str], env: dict, cwd: str, log_path: str, status_path: str,
          start_server: bool = True) -> ForkedLauncher | None:
    """Fork ``python -m testkit.ranks ARGV`` with ``env`` in ``cwd``, output to ``log_path``; None where this
    run cannot be forked (another environment than the server's, or no server). Without
    ``start_server`` (a run given an environment of its own) no server is started for this run: the server takes
    the environment of the run that starts it, and later plain runs must match it."""
    global _server
    with _lock:
        if _server is None and not start_server:
            STARTS["started afresh (its own environment, before any server)"] += 1
            return None
        if _server is None:
            with open(os.path.join(os.path.dirname(log_path), "zygote.log"), "w") as server_log:
                process = subprocess.Popen([sys.executable, "-m", "testkit.zygote"], env=env, cwd=os.getcwd(),
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=server_log,
                                           start_new_session=True)
            _server = {"process": process, "env": dict(env)}
        process = _server["process"]
        reason = _why_not(env)
        if reason:
            STARTS[f"started afresh ({reason})"] += 1
            return None
        request = {"argv": argv, "env": env, "cwd": cwd, "log": log_path, "status": status_path}
        answer = b""
        try:
            process.stdin.write((json.dumps(request) + "\n").encode())
            process.stdin.flush()
            if select.select([process.stdout], [], [], _ANSWER_TIMEOUT)[0]:
                answer = process.stdout.readline()  # the launcher's pid, once the server has preloaded and forked
        except OSError:
            pass
        if not answer.strip().isdigit():  # gone or stuck: this run and the next start the plain way
            STARTS["started afresh (the server did not answer)"] += 1
            process.kill()
            return None
        STARTS["forked"] += 1
        return ForkedLauncher(int(answer), status_path, process)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _why_not(env: dict) -> str | None:
    """Why a run with ``env`` cannot be forked by the server, or None."""
    if _server["process"].poll() is not None:
        return f"the server exited with code {_server['process'].returncode}"
    ours, theirs = _read_on_import(_server["env"]), _read_on_import(env)
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    return f"environment: {', '.join(changed)}" if changed else None


def _launcher(request: dict, server_fds: tuple[int, ...]) -> None:
    """In the forked child: become ``python -m testkit.ranks ARGV`` and leave with its exit code."""
    from testkit import ranks

    def become_launcher() -> int:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update(request["env"])
        if sys.path and sys.path[0] == os.getcwd():  # `python -m` put the server's working folder there
            sys.path[0] = request["cwd"]
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ranks.unbuffered_output()
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.argv = [ranks.__file__, *request["argv"]]
        return ranks.main(request["argv"])

    ranks.leave_as_main(become_launcher)


def _write_status(path: str, code: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)  # whole or absent: the test process never reads half of it


def serve() -> None:
    """The server's loop: a request (one JSON line) on stdin forks a launcher and answers its pid on stdout;
    finished launchers are reaped and their status written. Single-threaded, so that every fork is clean."""
    from testkit.ranks import preload

    reply = os.dup(1)  # answers go there; anything printed while preloading goes to the server's log
    os.dup2(2, 1)
    preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process ends the server by closing its stdin
    wake, woken = os.pipe()  # a launcher's exit (SIGCHLD) wakes the loop through this pipe
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: dict[int, str] = {}
    pending, open_ = b"", True
    while open_ or running:
        ready = select.select([0, wake] if open_ else [wake], [], [])[0]
        if wake in ready:
            os.read(wake, 1 << 12)
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                open_ = False
                for pid in running:  # the test process is gone: nothing of its runs may outlive it
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _launcher(request, (reply, wake, woken))  # never returns
                running[pid] = request["status"]
                os.write(reply, f"{pid}\n".encode())
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _write_status(running.pop(pid), os.waitstatus_to_exitcode(status))

if __name__ == "__main__":
    serve()
