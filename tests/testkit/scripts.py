"""Run an RL script (a demo) the way ``llmrl run`` runs it, but with :mod:`testkit.ranks` as the launcher, forked by
the session's server (:mod:`testkit.zygote`) where it can be: the demos' smoke tests then spend their time in the
demo, not in importing torch and DeepSpeed three times over (DeepSpeed's runner, its per-node launcher, each rank).
And run a command (``python -m MODULE``: a benchmark) forked by that server the same way (:func:`run_module`).

What ``llmrl run`` adds around the launcher (preparing builtin models first, the supervisor, the exit-code files)
is tested through ``llmrl run`` itself: ``test_launch_live``, ``test_interruptions_live`` and the PPO demo's smoke
test. Test code, never shipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def run_script(config: str, script: str, script_args=(), overrides=(), env: dict | None = None,
               cwd: str | os.PathLike | None = None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``script script_args`` as rank 0 of a run of ``config`` (with ``overrides``) and wait for its end.

    Returns a CompletedProcess whose ``stdout`` and ``stderr`` are both the run's whole output (every rank's
    lines interleaved, as ``llmrl run`` prints them). The run's working folder is ``cwd``, else the test
    process's."""
    from llmrl.engine.config import load_config
    from llmrl.engine.transport.rendezvous import free_port
    from testkit import live

    config_obj = load_config(config, list(overrides), check_environment=False, check_plugins=False)
    workdir = Path(tempfile.mkdtemp(prefix="llmrl-script-", dir=live.WORK_ROOT))
    command = [sys.executable, "-m", "testkit.ranks", str(config_obj.world_size), str(free_port()), "--", "-m",
               "llmrl.launch", "--config", config, *overrides, script, *script_args]
    log_path = workdir / "run.log"
    with open(log_path, "w") as log:
        process = live.start_launcher(command, env, str(cwd or os.getcwd()), log, str(workdir / "launcher.exit"))
        code = _wait_or_kill(process, timeout)
    output = log_path.read_text(errors="replace")
    return subprocess.CompletedProcess(command, code, output, output)


def run_module(module: str, args=(), env: dict | None = None, cwd: str | os.PathLike | None = None,
               timeout: float = 600.0) -> subprocess.CompletedProcess:
    """``python -m module args`` run to its end, forked by the session's server where it can be (an interpreter
    that imported torch, DeepSpeed, transformers and llmrl once for the whole session), else started the plain way.
    Returns a CompletedProcess with its ``stdout`` and ``stderr`` apart. For the tests of a command whose subject is
    what the command does (a benchmark's rows), not how an interpreter starts."""
    from testkit import live, zygote

    full_env = live.process_environment(env)
    workdir = Path(tempfile.mkdtemp(prefix="llmrl-module-", dir=live.WORK_ROOT))
    cwd = str(cwd or os.getcwd())
    command = [sys.executable, "-m", module, *args]
    out, err = workdir / "stdout", workdir / "stderr"
    process = zygote.start(module, list(args), full_env, cwd, str(out), str(workdir / "exit"), err_path=str(err),
                           server_env=live.server_environment(full_env))
    if process is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    code = _wait_or_kill(process, timeout)
    return subprocess.CompletedProcess(command, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def _wait_or_kill(process, timeout: float) -> int:
    """The exit code of ``process`` (a launcher or a forked command, the leader of its process group); past
    ``timeout`` its whole group is killed and TimeoutExpired raised."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait(30)
        raise
