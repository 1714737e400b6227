"""Run an RL script (a demo) the way ``llmrl run`` runs it, but with :mod:`testkit.ranks` as the launcher, forked by
the session's server (:mod:`testkit.zygote`) where it can be: the demos' smoke tests then spend their time in the
demo, not in importing torch and DeepSpeed three times over (DeepSpeed's runner, its per-node launcher, each rank).

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
    from testkit import live, zygote

    config_obj = load_config(config, list(overrides), check_environment=False, check_plugins=False)
    workdir = Path(tempfile.mkdtemp(prefix="llmrl-script-", dir=live.WORK_ROOT))
    argv = [str(config_obj.world_size), str(free_port()), "--", "-m", "llmrl.launch", "--config", config,
            *overrides, script, *script_args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    kit_parent = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (kit_parent, full_env.get("PYTHONPATH")) if p)
    log_path = workdir / "run.log"
    cwd = str(cwd or os.getcwd())
    # A server started for this run takes its environment: only when nothing in it is read at import time.
    own_imports = any(os.environ.get(k) != v for k, v in zygote._read_on_import(env or {}).items())
    process = zygote.start(argv, full_env, cwd, str(log_path), str(workdir / "launcher.exit"),
                           start_server=not own_imports)
    with open(log_path, "a") as log:
        if process is None:
            process = subprocess.Popen([sys.executable, "-m", "testkit.ranks", *argv], stdout=log,
                                       stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                       stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait(30)
            raise
    output = log_path.read_text(errors="replace")
    return subprocess.CompletedProcess(argv, code, output, output)
