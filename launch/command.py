"""Build the ``deepspeed ...`` command of a run, and the launcher command it comes down to: pure functions, tested
as data.

:func:`deepspeed_command` is the run as DeepSpeed's runner takes it. On one machine it asks for ``--num_gpus N``
with N = 1 client + every server rank (it also works on CPU); with a hostfile the slots must add up to N, checked
before anything starts. :func:`node_commands` gives the command of every node of a hostfile run started without
ssh (one per node, each with its ``--node_rank``), which ``llmrl run --dry-run`` prints and a SLURM job runs
through ``srun``.

Where the ranks all start on this machine (one machine, or one node started with ``--no_ssh``), the runner only
starts DeepSpeed's per-node launcher and waits: :func:`node_launcher_command` is that launcher's command, exactly
as the runner builds it, and ``llmrl run`` starts it directly, without the runner's process (which imports torch
and DeepSpeed first, about 2 CPU-seconds, to do nothing else). A hostfile run started over ssh goes through the
runner (pdsh).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field, replace

HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's default, used when a hostfile run names no --master_port


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
    # DeepSpeed's launcher chatter (per-process INFO lines) stays out of the way; None: "warning" with a hostfile,
    # "error" without one (on one machine its only warning is "Unable to find hostfile", printed on every run).
    launcher_log_level: str | None = None


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
    cmd += ["--log_level", _log_level(options), "--module"]
    return cmd + _rank_command(options)


def _log_level(options: RunOptions) -> str:
    return options.launcher_log_level or ("warning" if options.hostfile else "error")


def _rank_command(options: RunOptions) -> list[str]:
    """What every rank runs, after the launcher's own options: ``llmrl.launch`` with the config, the overrides and
    the client script (or ``-m MODULE``) with its arguments."""
    script = ["-m", options.module] if options.module else [options.script]
    return ["llmrl.launch", "--config", options.config, *options.overrides, *script, *options.script_args]


def node_launcher_command(options: RunOptions, world_size: int, slots: dict[str, int] | None = None,
                          python: str | None = None) -> list[str] | None:
    """The command DeepSpeed's runner executes for ``deepspeed_command(options, world_size)`` when this machine starts
    the ranks itself: its per-node launcher, ``python -u -m deepspeed.launcher.launch --world_info=...``, with the
    same ranks (``slots``: the hostfile's, else ``world_size`` on localhost), master, node rank, log level and rank
    command, in the runner's order (``tests/test_launcher_command.py`` compares it with DeepSpeed's own runner). None
    for a hostfile run started over ssh, which only the runner can start."""
    if slots is not None and not options.no_ssh:
        return None
    if slots is None:
        world, master_addr = {"localhost": list(range(world_size))}, "127.0.0.1"  # the runner's, whatever was given
    else:
        world, master_addr = {host: list(range(count)) for host, count in slots.items()}, options.master_addr
    world_info = base64.urlsafe_b64encode(json.dumps(world).encode("utf-8")).decode("utf-8")
    cmd = [python or sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
           f"--master_addr={master_addr}", f"--master_port={options.master_port or DEFAULT_MASTER_PORT}"]
    if options.no_ssh:
        cmd.append(f"--node_rank={options.node_rank or 0}")
    cmd += ["--module", "--enable_each_rank_log=None", f"--log_level={_log_level(options)}"]  # the runner's "None"
    return cmd + _rank_command(options)


@dataclass(frozen=True)
class NodeCommand:
    """What one node of a hostfile run executes when started without ssh."""

    host: str
    node_rank: int
    ranks: range  # the global ranks this node starts (rank 0, the client, is on node 0)
    argv: list[str]


def node_ranks(slots: dict[str, int], node_rank: int) -> range:
    """The global ranks started on node ``node_rank``: DeepSpeed numbers them host by host, in hostfile order."""
    counts = list(slots.values())
    if not 0 <= node_rank < len(counts):
        raise ValueError(f"node_rank {node_rank} is out of range: the hostfile names {len(counts)} node(s), "
                         f"so node ranks go from 0 to {len(counts) - 1}")
    first = sum(counts[:node_rank])
    return range(first, first + counts[node_rank])


def node_commands(options: RunOptions, slots: dict[str, int], executable: str = "deepspeed") -> list[NodeCommand]:
    """The ``deepspeed ...`` command of every node of a hostfile run, each started without ssh.

    ``llmrl run --no_ssh --node_rank R`` on node R runs exactly ``node_commands(...)[R].argv``. The master
    is ``options.master_addr`` or, as DeepSpeed assumes, the first host of the hostfile; the port is
    ``options.master_port`` or DeepSpeed's default 29500.
    """
    if not options.hostfile:
        raise ValueError("per-node commands need a hostfile")
    master_addr = options.master_addr or next(iter(slots))
    master_port = options.master_port or DEFAULT_MASTER_PORT
    world_size = sum(slots.values())
    return [NodeCommand(host=host, node_rank=rank, ranks=node_ranks(slots, rank),
                        argv=deepspeed_command(replace(options, no_ssh=True, node_rank=rank, master_addr=master_addr,
                                                       master_port=master_port), world_size, executable))
            for rank, host in enumerate(slots)]


def split_options(argv: list[str], names: tuple[str, ...], verb: str) -> tuple[list[str], list[str]]:
    """``(the rest, the options named in names)``: each named option and its value (``--port 8000`` or
    ``--port=8000``) moves to the second list, in order (how ``llmrl tinker`` and ``llmrl openai`` hand their own
    options to the service and the rest to ``llmrl run``). Exits naming ``verb`` when a named option lacks its
    value."""
    rest, taken, k = [], [], 0
    while k < len(argv):
        token = argv[k]
        if token.split("=", 1)[0] in names:
            if "=" in token:
                taken.append(token)
            elif k + 1 < len(argv):
                taken += [token, argv[k + 1]]
                k += 1
            else:
                raise SystemExit(f"{verb}: {token} needs a value")
        else:
            rest.append(token)
        k += 1
    return rest, taken
