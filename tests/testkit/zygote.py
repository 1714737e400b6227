"""A fork server for :class:`testkit.LiveRun` and the tests of commands: one process per test session imports torch,
DeepSpeed, transformers, PEFT and llmrl once (:func:`testkit.ranks.preload`), then forks a fresh ``python -m MODULE
ARGV`` for each request: a run's launcher (:mod:`testkit.ranks`, or DeepSpeed's per-node launcher), or a command
under test (a benchmark, :func:`testkit.scripts.run_module`). Without it each of them imports those libraries again
first: about 4 CPU-seconds, on one core, before it does anything; the suite starts some seventy.

A forked process is what ``python -m MODULE ARGV`` started by :class:`subprocess.Popen` would be: its own session
(``start_new_session``), the request's environment, working folder and output files, stdin from ``/dev/null``, a
fresh interpreter's signal dispositions and unbuffered output; it exits with the code the module leaves with. The
server writes each one's exit status (``Popen.returncode``'s convention: ``-N`` when killed by signal N) to a file
the requester reads (:class:`ForkedLauncher`). The test process talks to its server over the server's stdin and
stdout; the processes it starts (a benchmark starting live runs of its own) reach the same server through a Unix
socket, named in their environment (:data:`ADDRESS_ENV`).

The interpreter and the libraries read some environment variables when they start or are imported. So a process is
forked only when its environment agrees with the server's in every such variable (:data:`_READ_ON_IMPORT`) but
``PYTHONPATH``; any other is started the plain way, and :func:`start` returns None for it. A forked process takes the
request's whole environment, and its working folder: it changes to it, and its ``sys.path`` is the one a fresh
``python -m`` would have there, the request's ``PYTHONPATH`` folders in place of the server's; where that
``PYTHONPATH`` could change where a module the server imported comes from, it is started the plain way too
(:mod:`testkit.zygote_paths`). The
server's own output goes to ``zygote.log`` beside the first run's log. When the test process ends, the server's
stdin closes: it kills what is left of its processes' sessions and exits.

Test code, never shipped.
"""

from __future__ import annotations

import collections
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from testkit.zygote_paths import ServerPath


class ForkedLauncher:
    """A launcher forked by the server: the part of :class:`subprocess.Popen` that LiveRun and the tests use."""

    def __init__(self, pid: int, status_path: str, server_poll):
        self.pid = pid
        self.returncode = None
        self._status_path = status_path
        self._server_poll = server_poll  # None while the server (which reaps the launcher) lives

    def poll(self):
        if self.returncode is None:
            if os.path.exists(self._status_path):
                with open(self._status_path) as f:
                    self.returncode = int(f.read())
            elif self._server_poll() is not None and not _exists(self.pid):
                self.returncode = 1  # its status was lost with the server (which reaps it) before it was written
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
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
ADDRESS_ENV = "LLMRL_TEST_FORK_SERVER"  # the server's socket, for the processes the test process starts
_lock = threading.Lock()
STARTS: collections.Counter = collections.Counter()  # how this process's runs started: forked, or afresh and why
_server: dict | None = None  # {"process"} of this test process's server, once started


def start(module: str, argv: list[str], env: dict, cwd: str, log_path: str, status_path: str,
          start_server: bool = True, err_path: str | None = None, server_env: dict | None = None
          ) -> ForkedLauncher | None:
    """Fork ``python -m MODULE ARGV`` with ``env`` in ``cwd``, its output to ``log_path`` (its standard error to
    ``err_path`` if given); None where it cannot be forked (another environment than the server's, or no server).

    The test process starts the server on its first call; a process it started (a benchmark, say) asks that same
    server, through the socket named by :data:`ADDRESS_ENV`. Without ``start_server`` (a run given an environment
    of its own) no server is started for this run: the server takes the environment of the run that starts it
    (``server_env`` if given), and later plain runs must match it."""
    request = {"module": module, "argv": argv, "env": env, "cwd": cwd, "log": log_path, "err": err_path or log_path,
               "status": status_path}
    with _lock:
        if _server is None and os.path.exists(env.get(ADDRESS_ENV) or os.environ.get(ADDRESS_ENV, "")):
            return _ask_by_socket(env.get(ADDRESS_ENV) or os.environ[ADDRESS_ENV], request)
        if _server is None and not start_server:
            STARTS["started afresh (its own environment, before any server)"] += 1
            return None
        if _server is None:
            _start_server(server_env or env, os.path.dirname(log_path))
        request["env"] = {**env, ADDRESS_ENV: os.environ[ADDRESS_ENV]}  # what it starts can ask the server too
        process = _server["process"]
        if process.poll() is not None:
            STARTS[f"started afresh (the server exited with code {process.returncode})"] += 1
            return None
        answer = b""
        try:
            process.stdin.write((json.dumps(request) + "\n").encode())
            process.stdin.flush()
            if select.select([process.stdout], [], [], _ANSWER_TIMEOUT)[0]:
                answer = process.stdout.readline()  # the launcher's pid, once the server has preloaded and forked
        except OSError:
            pass
        return _forked(answer.decode(errors="replace"), status_path, process.poll)


def _start_server(env: dict, folder: str) -> None:
    """Start this test process's server (with ``env``, its output in ``folder``), and name its socket in this
    process's environment, which the processes it starts from now on inherit."""
    global _server
    address = os.path.join(tempfile.mkdtemp(prefix="llmrl-zygote-"), "socket")
    with open(os.path.join(folder, "zygote.log"), "w") as server_log:
        process = subprocess.Popen([sys.executable, "-m", "testkit.zygote", address], env=env, cwd=os.getcwd(),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=server_log,
                                   start_new_session=True)
    _server = {"process": process}
    os.environ[ADDRESS_ENV] = address


def _ask_by_socket(address: str, request: dict) -> ForkedLauncher | None:
    """The request of a process the test process started, to its server."""
    import socket

    answer = ""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_ANSWER_TIMEOUT)
            conn.connect(address)
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = conn.makefile().readline()
    except OSError:
        pass
    server = int(answer.split()[1]) if len(answer.split()) == 2 and answer.split()[1].isdigit() else None
    return _forked(answer.split()[0] if server else answer, request["status"],
                   lambda: None if server is not None and _exists(server) else 1)


def _forked(answer: str, status_path: str, server_poll) -> ForkedLauncher | None:
    """The launcher the server forked, from its answer (the pid, or why it could not); None if it could not."""
    answer = answer.strip()
    if not answer.isdigit():  # another environment, or the server gone or stuck: started the plain way
        STARTS[f"started afresh ({answer or 'the server did not answer'})"] += 1
        return None
    STARTS["forked"] += 1
    return ForkedLauncher(int(answer), status_path, server_poll)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def why_not(server_env: dict, env: dict, cwd: str | None = None, path: ServerPath | None = None) -> str | None:
    """Why a run with ``env`` (in ``cwd``) cannot be forked by a server started with ``server_env``, or None. With
    the server's ``path``, a ``PYTHONPATH`` of its own is judged by :meth:`ServerPath.why_not`; without, it must be
    the server's."""
    ours, theirs = _read_on_import(server_env), _read_on_import(env)
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)
                     and (path is None or k != "PYTHONPATH"))
    if changed:
        return f"environment: {', '.join(changed)}"
    return None if path is None else path.why_not(env.get("PYTHONPATH"), cwd or os.getcwd())


def _launcher(request: dict, server_fds: tuple[int, ...], sys_path: list[str]) -> None:
    """In the forked child: become ``python -m MODULE ARGV`` and leave with its exit code."""
    from testkit import ranks

    def become_launcher() -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(err, 2)
        for fd in {null, log, err}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = sys_path  # a fresh `python -m`'s in the request's folder, with its PYTHONPATH
        importlib.invalidate_caches()  # what the server's finders (and importlib.metadata) saw of them, forgotten
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ranks.unbuffered_output()
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.argv = [request["module"], *request["argv"]]
        sys.modules.pop(request["module"], None)  # preloaded (testkit.ranks): run afresh as __main__, as python -m does
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)

    ranks.leave_as_main(become_launcher)


def _write_status(path: str, code: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)  # whole or absent: the test process never reads half of it


def serve(address: str) -> None:
    """The server's loop: a request (one JSON line) on stdin, or on a connection to the socket at ``address``, forks
    a launcher and answers its pid (on stdout, or on the connection with the server's pid after it), or why it
    cannot; finished launchers are reaped and their status written. Single-threaded, so that every fork is clean."""
    import socket

    from testkit.ranks import preload

    reply = os.dup(1)  # answers go there; anything printed while preloading goes to the server's log
    os.dup2(2, 1)
    started_with = dict(os.environ)
    path = ServerPath(started_with.get("PYTHONPATH"), os.getcwd())  # as the interpreter started, before any import
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process ends the server by closing its stdin
    wake, woken = os.pipe()  # a launcher's exit (SIGCHLD) wakes the loop through this pipe
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: dict[int, str] = {}

    def fork(line: bytes) -> str:
        request = json.loads(line)
        reason = why_not(started_with, request["env"], request["cwd"], path)
        if reason:
            return reason
        sys_path = path.for_request(request["env"].get("PYTHONPATH"), request["cwd"])
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _launcher(request, (reply, wake, woken, listener.fileno()), sys_path)  # never returns
        running[pid] = request["status"]
        return str(pid)

    pending, open_ = b"", True
    while open_ or running:
        ready = select.select([0, wake, listener] if open_ else [wake], [], [])[0]
        if wake in ready:
            os.read(wake, 1 << 12)
        if listener in ready:  # a process of the test's asks; it waits for the answer, so one line is whole soon
            conn = listener.accept()[0]
            with conn:
                conn.settimeout(10)
                try:
                    line = conn.makefile("rb").readline()
                    conn.sendall(f"{fork(line) if line.strip() else 'an empty request'} {os.getpid()}\n".encode())
                except OSError:
                    pass
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                open_ = False
                for pid in running:  # the test process is gone: nothing of its runs may outlive it
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                listener.close()
                os.unlink(address)
                os.rmdir(os.path.dirname(address))  # made for the socket alone (_start_server)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                os.write(reply, f"{fork(line)}\n".encode())
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _write_status(running.pop(pid), os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    serve(sys.argv[1])
