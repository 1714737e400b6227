"""Live runs for tests: :class:`LiveRun` starts a real run (every rank a process) whose client script
(:mod:`testkit.proxy`) obeys the test process. Ranks are started by :mod:`testkit.ranks` (the environment
DeepSpeed's launcher gives them, without importing DeepSpeed twice first), or, with ``launcher="deepspeed"``, by
DeepSpeed's per-node launcher itself (fresh processes), for tests whose subject is what the launcher does. Either
launcher is forked by the session's server (:mod:`testkit.zygote`) where the run's environment allows.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

WORK_ROOT: str | None = None  # where runs' folders go; the suite's conftest points it into pytest's own basetemp


class LiveRun:
    """A real run (DeepSpeed launcher, every rank a process) whose client obeys this process.

    ``config`` is a mapping (written to a temporary YAML file) or a path. Methods of the run's
    :class:`~llmrl.Caller` are called as ``run.score(...)``; exceptions raised there are raised here.

    Example::

        with LiveRun({"llms": {"main": {"model": tiny_model("llama")}}}) as run:
            print(run.score(["a"], [[" b"]]))
    """

    def __init__(self, config, *, caller_kwargs: dict | None = None, overrides=(), env: dict | None = None,
                 startup_timeout: float = 300.0, workdir: str | None = None, check: bool = True,
                 launcher: str = "direct"):
        import secrets
        from multiprocessing.connection import Listener

        import yaml

        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="llmrl-live-", dir=WORK_ROOT))
        if isinstance(config, (str, os.PathLike)):
            self.config_path = str(config)
            with open(config) as f:
                raw = yaml.safe_load(f)
        else:
            raw = config
            self.config_path = str(self.workdir / "config.yaml")
            with open(self.config_path, "w") as f:
                yaml.safe_dump(config, f, sort_keys=False)
        from llmrl.engine.config import load_config

        self.config = load_config(raw=raw, overrides=list(overrides), check_environment=False, check_plugins=False)
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        from llmrl.engine.transport.rendezvous import free_port
        from llmrl.launch.command import RunOptions, node_launcher_command

        options = RunOptions(config=self.config_path, module="testkit.proxy",
                             script_args=[f"{host}:{port}", key.hex()], overrides=list(overrides),
                             master_port=free_port())
        self.master_port = options.master_port  # the run's TCP store (rank 0 hosts it)
        if launcher == "deepspeed":  # DeepSpeed's per-node launcher, as `llmrl run` starts it on one machine
            self.command = node_launcher_command(options, self.config.world_size)
        elif launcher == "direct":
            import sys

            self.command = [sys.executable, "-m", "testkit.ranks", str(self.config.world_size),
                            str(options.master_port), "--", "-m", "llmrl.launch", "--config", self.config_path,
                            *options.overrides, "-m", options.module, *options.script_args]
        else:
            raise ValueError(f"launcher must be 'direct' or 'deepspeed', not {launcher!r}")
        self.log_path = self.workdir / "run.log"
        self._log = open(self.log_path, "w")
        self.process = start_launcher(self.command, env, os.getcwd(), self._log, str(self.workdir / "launcher.exit"))
        self._conn = self._accept(startup_timeout)
        self._conn.send(caller_kwargs or {})
        status, value = self._recv(startup_timeout)
        if status != "ok":
            self.kill()
            raise value
        self.info = value

    def _accept(self, timeout: float):
        import threading
        import time

        box: list = []
        thread = threading.Thread(target=lambda: box.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline and self.process.poll() is None:
            thread.join(0.2)
        if not box:
            self.kill()
            raise RuntimeError(f"the run did not start (exit code {self.process.poll()}); log:\n{self.log}")
        from testkit.proxy import _Channel

        return _Channel(box[0])

    def _recv(self, timeout: float | None = None):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None and not self._conn.poll(0.5):
                raise RuntimeError(f"the run exited with code {self.process.returncode}; log:\n{self.log}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the run within {timeout} s; log:\n{self.log}")
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError) as err:
            raise self._ended(err) from err

    def _ended(self, err: BaseException) -> RuntimeError:
        """The error for a client that went away (the launcher ends every rank when one dies)."""
        import subprocess

        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            pass
        return RuntimeError(f"the run's client closed the connection ({type(err).__name__}; run exit code "
                            f"{self.process.poll()}); log:\n{self.log}")

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (EOFError, ConnectionError) as err:
            raise self._ended(err) from err

    def call(self, method: str, *args, timeout: float | None = 600.0, **kwargs):
        self._send(("call", method, args, kwargs))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def many(self, method: str, calls: list[tuple[tuple, dict]], timeout: float | None = 600.0):
        """Start ``method_async`` once per ``(args, kwargs)`` at the same time; their results in order."""
        self._send(("many", method, calls))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def threads(self, method: str, threads: int, rounds: int, calls: list, timeout: float | None = 600.0):
        """``threads`` client threads each make ``rounds`` calls (thread t's round r is ``calls[(t + r) % n]``);
        their results, ``[thread][round]``."""
        self._send(("threads", method, threads, rounds, calls))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def in_callback(self, first: tuple, then: tuple, timeout: float | None = 600.0):
        """Make the call ``then`` ``(method, args, kwargs)`` in the done-callback of the future of ``first``'s."""
        self._send(("in_callback", first, then))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def with_client_only(self, method: str, key: str, *args, timeout: float | None = 600.0, **kwargs):
        """Call ``method`` with ``key=[an object only the client can decode]``."""
        self._send(("with_client_only", method, args, kwargs, key))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def function(self, target: str, *args, timeout: float | None = 600.0, **kwargs):
        """Call ``module:attr`` in the run's client process as ``attr(caller, *args, **kwargs)`` (a test kit helper
        that holds something the Caller cannot send back, such as a server on a thread)."""
        self._send(("function", target, args, kwargs))
        status, value = self._recv(timeout)
        if status != "ok":
            raise value
        return value

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def exit_script(self, code: int) -> None:
        """Make the client script exit with ``code`` (without closing the Caller)."""
        self._send(("exit", code))
        self._recv(60)

    def raise_in_script(self, message: str) -> None:
        self._send(("raise", message))
        self._recv(60)

    def wait(self, timeout: float = 120.0) -> int:
        import subprocess

        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self, timeout: float = 120.0) -> int:
        """Close the Caller (servers stop cleanly) and wait for every process; the launcher's exit code."""
        if self.process.poll() is None:
            try:
                self.call("close", timeout=timeout)
            except (RuntimeError, EOFError, OSError):
                pass
        code = self.wait(timeout)
        self._cleanup()
        return code

    def kill(self) -> None:
        """SIGKILL to the launcher's session; returns once its processes are gone (a rank holding gigabytes takes a
        moment to exit after the signal), or after 30 s."""
        import signal
        import time

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(30)
        except Exception:  # noqa: BLE001
            pass
        deadline = time.monotonic() + 30
        while self.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the event: no process of the run left
        self._cleanup()

    def _cleanup(self) -> None:
        for closer in (getattr(self, "_conn", None), self._listener, self._log):
            try:
                if closer is not None:
                    closer.close()
            except OSError:
                pass

    def leftover_processes(self) -> list[int]:
        """PIDs of processes of this run still alive (there should be none after it ends): those whose command line
        names the run's config (ranks), and those of the launcher's session (the launcher, forked or not, leads its
        own: a forked one's command line is the fork server's)."""
        import psutil

        alive = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                in_command = self.config_path in " ".join(proc.info["cmdline"] or [])
                if (in_command or _session(proc.pid) == self.process.pid) and proc.info["status"] != "zombie":
                    alive.append(proc.info["pid"])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return alive

    @property
    def log(self) -> str:
        try:
            self._log.flush()
        except (OSError, ValueError):
            pass
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.kill()
            return
        code = self.close(timeout=60)
        assert code == 0, f"the run exited with {code} when its Caller closed (a crash at shutdown); log:\n{self.log}"


def start_launcher(command: list[str], env: dict | None, cwd: str, log, status_path: str, fork: bool = True):
    """Start a run's launcher ``command`` (``python -m testkit.ranks ...``, or DeepSpeed's ``python -u -m
    deepspeed.launcher.launch ...``) in ``cwd`` with :func:`process_environment` (``env`` added), its output to the
    open file ``log``. A ``python [-u] -m MODULE`` command (``fork``) is forked by the session's server where it can
    be (:mod:`testkit.zygote`, whose processes write unbuffered as ``-u`` does; ``status_path`` receives its exit
    status); else, or where it cannot, it is a process of its own session. Either way it leads its own session,
    which :meth:`LiveRun.leftover_processes` looks for. Returns the process (a Popen, or what the server forked)."""
    import subprocess

    from testkit import zygote

    full_env = process_environment(env)
    module = _python_module(command) if fork else None
    if module is not None:
        # A server started for this run takes its environment, but the test process's PYTHONPATH (the server judges
        # a run's own): only when nothing else in it is read at import time.
        own = {k: v for k, v in zygote._read_on_import(env or {}).items() if k != "PYTHONPATH"}
        own_imports = any(os.environ.get(k) != v for k, v in own.items())
        process = zygote.start(module[0], module[1], full_env, cwd, log.name, status_path,
                               start_server=not own_imports, server_env=server_environment(full_env))
        if process is not None:
            return process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                            cwd=cwd, stdin=subprocess.DEVNULL)


def _python_module(command: list[str]) -> tuple[str, list[str]] | None:
    """``(MODULE, ARGS)`` of a command ``[sys.executable, (-u), -m, MODULE, *ARGS]``, else None."""
    import sys

    if command[:1] != [sys.executable]:
        return None
    rest = command[1:]
    while rest[:1] == ["-u"]:  # the server's forked processes write unbuffered
        rest = rest[1:]
    return (rest[1], rest[2:]) if len(rest) >= 2 and rest[0] == "-m" else None


def server_environment(full_env: dict) -> dict:
    """The environment of a fork server a process with ``full_env`` starts: that one, with the test process's own
    ``PYTHONPATH`` (the server judges a request's ``PYTHONPATH`` against its own, :mod:`testkit.zygote_paths`)."""
    return {**full_env, "PYTHONPATH": process_environment(None)["PYTHONPATH"]}


def process_environment(env: dict | None) -> dict:
    """The whole environment of a process the tests start: this process's, unbuffered output, ``env``, and the test
    kit's folder first on ``PYTHONPATH`` (every rank imports it, and test plugins)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    kit_parent = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths[:1] != [kit_parent]:  # the same for a process started by one the tests started (a benchmark's runs)
        full_env["PYTHONPATH"] = os.pathsep.join([kit_parent, *paths])
    return full_env


def _session(pid: int) -> int | None:
    """The session of process ``pid`` (a run's launcher leads its own; ranks forked from a server keep no trace of
    the run in their command line)."""
    try:
        return os.getsid(pid)
    except OSError:
        return None
