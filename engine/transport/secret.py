"""The run's secret: every rank of a run holds the same random key, which is never published anywhere.

``llmrl run`` draws the secret and hands it to the launcher in the environment (``LLMRL_RUN_SECRET``, hex);
the DeepSpeed launcher passes its environment to every rank it starts on the node, and to other nodes
through the file named by ``DS_ENV_FILE``. Several nodes started one by one (``--no_ssh``, SLURM) must be
given the same ``LLMRL_RUN_SECRET`` by the user. A plain single-node ``deepspeed ... --module llmrl.launch``
launch has no secret in its environment: then rank 0 writes one to a file only its user can read, named
after the launcher process that every rank of the node shares, and the servers read it from there.

This module hands out bytes; the handshake that uses them is in :mod:`llmrl.engine.transport.frames`.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

ENV = "LLMRL_RUN_SECRET"


def new_secret() -> str:
    return secrets.token_hex(32)


def from_environment() -> bytes | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        raise ValueError(f"{ENV} must be a hex string (e.g. the output of `python -c \"import secrets; "
                         f"print(secrets.token_hex(32))\"`)") from None
    if len(key) < 16:
        raise ValueError(f"{ENV} is too short: give at least 16 random bytes (32 hex digits)")
    return key


def _local_file() -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache" / "llmrl" / "run-secrets")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base / f"llmrl-run-{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}.secret"


def client_secret() -> tuple[bytes, Path | None]:
    """Rank 0's secret, and the file it wrote when the launcher gave none (to be removed at the end of the run)."""
    key = from_environment()
    if key is not None:
        return key, None
    _require_single_node()
    path = _local_file()
    key = secrets.token_bytes(32)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.hex().encode())
    os.replace(staging, path)  # servers never read a half-written key
    return key, path


def server_secret(timeout: float) -> bytes:
    """A server's secret: from the environment, or from the file rank 0 of this node writes."""
    key = from_environment()
    if key is not None:
        return key
    _require_single_node()
    import psutil

    path = _local_file()
    launcher_started = psutil.Process(os.getppid()).create_time()
    deadline = time.monotonic() + timeout
    while True:
        try:
            fresh = path.stat().st_mtime >= launcher_started - 1.0  # not a file left by an earlier run
            text = path.read_text().strip() if fresh else ""
            if len(text) == 64:
                return bytes.fromhex(text)
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no run secret in {path} within {timeout:.0f} s; set {ENV} (hex) in "
                               "the launcher's environment")
        time.sleep(0.05)


def _require_single_node() -> None:
    if int(os.environ.get("CROSS_SIZE", "1")) > 1:
        raise RuntimeError(f"a run over several nodes needs the same secret on every node: start it with `llmrl run` "
                           f"(which draws one), or set {ENV} to the same hex string on every node (e.g. "
                           "`export LLMRL_RUN_SECRET=$(python -c \"import secrets; print(secrets.token_hex(32))\")`")
