"""A minimal stand-in for DeepSpeed's launcher, for tests about what runs *inside* the ranks.

``python -m testkit.ranks WORLD_SIZE MASTER_PORT -- [-m module | script] args...`` starts ``WORLD_SIZE`` ranks
on this machine with the environment DeepSpeed's per-node launcher gives them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and a first
argument ``--local_rank=N``), waits for them, ends them all as soon as one fails (as DeepSpeed's launcher does),
and exits with the first failing rank's code (0 when all succeed).

Why: DeepSpeed's runner and its per-node launcher each import DeepSpeed (and torch) before the first rank
starts, several seconds per run on our CPUs, twice. Tests of scoring, training and plugins start dozens of
runs and do not test the launcher; the launcher itself is tested through ``llmrl run`` and raw ``deepspeed``
(``test_launch_live``, ``test_interruptions_live``, ``test_two_hosts_live``, and the reliability tests that
kill ranks). It is test code, never shipped.

Each rank is a **fork** of this process taken after it imported torch, DeepSpeed, transformers and llmrl's rank
code once (:data:`PRELOAD`): a rank then starts without importing them again, about 3 CPU-seconds a rank,
which on two cores is most of a test run's start-up. The child sets its rank's environment, its signal
dispositions and unbuffered output as a fresh ``python -u`` would have them, and runs the module (or script)
as ``__main__`` with the rank's arguments; nothing has started a thread when it forks (checked).
"""

from __future__ import annotations

import gc
import importlib
import io
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

# PEFT too (with bitsandbytes and torch's inductor, which it imports): about 3.5 CPU-seconds a LoRA rank. Importing
# it turns torch.distributions' argument checks off for the whole process (torch._dynamo's one-time patch); a rank
# with or without adapters runs its updater with them on all the same (llmrl's trainer turns them on for updaters).
# jsonschema: every rank checks its config against the schema (about 0.2 CPU-s to import, on every rank);
# matplotlib: every training example's client draws its learning curve (0.6 CPU-s; no back end is chosen here).
PRELOAD = ("torch", "deepspeed", "transformers", "transformers.models.llama.modeling_llama", "peft",
           "deepspeed.runtime.zero.muon.muon_optimizer", "llmrl.launch.rank", "llmrl.engine.model.hf_backend",
           "jsonschema", "matplotlib.pyplot")
# Every module of these packages too (a rank imports most of them, each compiled from source where Python writes no
# bytecode cache): they import their heavy dependencies lazily, so this costs a fraction of a second, once.
PRELOAD_PACKAGES = ("llmrl.engine", "llmrl.plugins")


def preload() -> None:
    """Import what every rank imports (:data:`PRELOAD`, :data:`PRELOAD_PACKAGES`), checking that no thread started:
    a process is forked from here."""
    import pkgutil

    for name in PRELOAD:
        importlib.import_module(name)
    for package in PRELOAD_PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)
    assert threading.active_count() == 1, f"a thread started while preloading: {threading.enumerate()}"
    # What was preloaded is kept for good: out of the collector's sight (gc.freeze), a forked process's collections
    # never walk it, so they do not write to (and copy) the memory pages it shares with this process.
    gc.collect()
    gc.freeze()


class ForkedRank:
    """One rank, forked from this process: the part of :class:`subprocess.Popen` this launcher uses."""

    def __init__(self, command: list[str], env: dict, sigint):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            _run_child(command, env, sigint)  # never returns

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(command: list[str], env: dict, sigint) -> None:
    """In the forked child: become the rank (``[-m module | script] args``) and leave with its exit code."""
    def become_rank() -> None:
        os.environ.clear()
        os.environ.update(env)
        # what a fresh interpreter has: Python's Ctrl-C handler (or an inherited "ignore"), default SIGTERM
        signal.signal(signal.SIGINT, signal.default_int_handler if sigint is not signal.SIG_IGN else sigint)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        unbuffered_output()
        from testkit.cpu_float16 import allow_if_asked

        allow_if_asked()  # (only where the run's environment asks: float16 tests on CPUs without float16 kernels)
        if command[0] == "-m":
            sys.argv = ["-m", *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            runpy.run_path(command[0], run_name="__main__")

    leave_as_main(become_rank)


def unbuffered_output() -> None:
    """``sys.stdout`` and ``sys.stderr`` on file descriptors 1 and 2, written through, as ``python -u`` has them."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True))


def leave_as_main(body) -> NoReturn:
    """Run ``body()`` in a forked child as an interpreter runs ``__main__``, then leave with the exit code a fresh
    process would have (its return value or SystemExit's, 130 for Ctrl-C, 1 for an uncaught exception, which is
    printed) once the ``atexit`` handlers ran and the output is flushed; never returns to the forking code."""
    code = 1
    try:
        result = body()
        code = 0 if result is None else result
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing left to report to
                pass
        os._exit(code)


def main(argv: list[str]) -> int:
    world_size, master_port, separator, *command = argv
    assert separator == "--", "usage: python -m testkit.ranks WORLD_SIZE MASTER_PORT -- [-m module | script] args"
    head = command[:2] if command[0] == "-m" else command[:1]
    rest = command[len(head):]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": world_size,
           "LOCAL_SIZE": world_size, "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    sigint = signal.getsignal(signal.SIGINT)
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for rank in range(int(world_size)):
        env_rank = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(ForkedRank([*head, f"--local_rank={rank}", *rest], env_rank, sigint))

    def stop(signum, _frame):
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    failed = 0
    while any(p.poll() is None for p in ranks):
        codes = [p.poll() for p in ranks]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and not failed:
            failed = bad[0]
            culprit = codes.index(failed)
            print(f"testkit.ranks: rank {culprit} exited with code {failed}; stopping the others", file=sys.stderr,
                  flush=True)
            for process in ranks:
                if process.poll() is None:
                    process.terminate()
            deadline = time.monotonic() + 30
            while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
                time.sleep(0.05)
            for process in ranks:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.05)
    codes = [p.wait() for p in ranks]
    for rank, rank_code in enumerate(codes):
        if rank_code != 0 and not failed:
            print(f"testkit.ranks: rank {rank} exited with code {rank_code}", file=sys.stderr, flush=True)
    code = failed or next((c for c in codes if c != 0), 0)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
