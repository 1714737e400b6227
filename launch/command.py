"""Build the ``deepspeed ...`` command of a run: pure functions, tested as data.

``llmrl run`` calls :func:`deepspeed_command` and only then runs the result. On one machine the
command asks for ``--num_gpus N`` with N = 1 client + every server rank (it also works on CPU); with
a hostfile the slots must add up to N, checked before anything starts.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field

HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


@dataclass
class RunOptions:
    config: str
    script: str | None = None
    module: str | None = None
    script_args: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    no_ssh: bool = False
    node_rank: int | None = None
    launcher_log_level: str = "warning"  # DeepSpeed's launcher chatter (per-process INFO lines) stays out of the way
    extra_launcher_args: list[str] = field(default_factory=list)


def hostfile_slots(text: str) -> dict[str, int]:
    """Host -> slots of a DeepSpeed hostfile (``hostname slots=N`` lines, # comments)."""
    slots: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if not match:
            raise ValueError(f"hostfile line {number} is not 'hostname slots=N': {raw!r}")
        slots[match.group(1)] = int(match.group(2))
    if not slots:
        raise ValueError("the hostfile names no host")
    return slots


def deepspeed_executable() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return beside if os.path.exists(beside) else (shutil.which("deepspeed") or "deepspeed")


def deepspeed_command(options: RunOptions, world_size: int, executable: str = "deepspeed") -> list[str]:
    """The argv that launches the run; rank 0 runs the script, the other ranks serve."""
    cmd = [executable]
    if options.hostfile:
        cmd += ["--hostfile", options.hostfile]
    else:
        cmd += ["--num_gpus", str(world_size)]
    if options.no_ssh:
        cmd += ["--no_ssh", "--node_rank", str(options.node_rank or 0)]
    if options.master_addr:
        cmd += ["--master_addr", options.master_addr]
    if options.master_port:
        cmd += ["--master_port", str(options.master_port)]
    cmd += ["--log_level", options.launcher_log_level]
    cmd += list(options.extra_launcher_args)
    cmd += ["--module", "llmrl.launch", "--config", options.config, *options.overrides]
    cmd += ["-m", options.module] if options.module else [options.script]
    return cmd + list(options.script_args)
