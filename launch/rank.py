"""The entry point of every rank: validate the config, check the rank count, become client or server.

The DeepSpeed launcher runs ``python -m llmrl.launch [--local_rank=N] --config CONFIG [key=value ...]
SCRIPT [script args]`` (or ``-m MODULE`` instead of SCRIPT) on every rank. Rank 0 runs the script as
``__main__`` with only its own arguments; every other rank becomes an LLM server and never runs it.
A bad config or a wrong rank count makes every rank exit at once with code 2 and one message per
node (printed by local rank 0). Before any rank becomes client or server (so before any process
group exists), local rank 0 of each node prepares the config's ``builtin:`` models while the node's
other ranks wait for them.

This module only decides who does what; the client and server live in :mod:`llmrl.engine`.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field

USAGE = ("usage: python -m llmrl.launch --config CONFIG [key.sub=value ...] (SCRIPT | -m MODULE) [script args]\n"
         "       (normally started by `llmrl run` or `deepspeed --module llmrl.launch ...`)")


@dataclass
class RankArgs:
    config: str
    overrides: list[str] = field(default_factory=list)
    script: str | None = None
    module: str | None = None
    script_args: list[str] = field(default_factory=list)
    local_rank: int | None = None


def is_override(token: str) -> bool:
    key, sep, _ = token.partition("=")
    return bool(sep) and not token.startswith("-") and bool(key) and all(
        part.replace("_", "").replace("-", "").isalnum() for part in key.split("."))


def parse_rank_args(argv: list[str]) -> RankArgs:
    """Parse ``[--local_rank=N] --config C [overrides] (SCRIPT | -m MODULE) [args]``; raises ValueError."""
    config, overrides, local_rank = None, [], None
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--local_rank"):
            if "=" in token:
                local_rank = int(token.split("=", 1)[1])
            else:
                i += 1
                local_rank = int(argv[i])
        elif token == "--config" or token.startswith("--config="):
            if "=" in token:
                config = token.split("=", 1)[1]
            else:
                i += 1
                if i >= len(argv):
                    raise ValueError("--config needs a path")
                config = argv[i]
        elif token == "-m":
            if i + 1 >= len(argv):
                raise ValueError("-m needs a module name")
            if config is None:
                raise ValueError("--config CONFIG is required")
            return RankArgs(config, overrides, None, argv[i + 1], argv[i + 2:], local_rank)
        elif is_override(token):
            overrides.append(token)
        elif token.startswith("-"):
            raise ValueError(f"unknown option {token!r} before the script")
        else:
            if config is None:
                raise ValueError("--config CONFIG is required")
            return RankArgs(config, overrides, token, None, argv[i + 1:], local_rank)
        i += 1
    if config is None:
        raise ValueError("--config CONFIG is required")
    raise ValueError("no script given: pass SCRIPT or -m MODULE after the config")


def run_script(args: RankArgs) -> int:
    """Run the user's script as __main__ with its own argv; return its exit code."""
    from llmrl.engine.client import describe_exit

    if args.module:
        sys.argv = [args.module, *args.script_args]
        sys.path.insert(0, os.getcwd())
    else:
        sys.argv = [args.script, *args.script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        if args.module:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.script, run_name="__main__")
        return 0
    except SystemExit as stop:
        return describe_exit(stop.code)
    except KeyboardInterrupt:
        print("llmrl: interrupted (Ctrl-C); stopping the servers", file=sys.stderr, flush=True)
        return 130
    except BaseException:  # noqa: BLE001 - the script's own error, shown as Python would
        traceback.print_exc()
        return 1


def prepare_builtin_models(config, rank: int, local_rank: int) -> str | None:
    """Make the config's ``builtin:`` models ready on this node before any process group exists.

    Local rank 0 prepares them (converts, verifies, installs; see :mod:`llmrl.engine.builtin_models`)
    while the node's other ranks wait for the entries to appear, for at most ``timeouts.startup``.
    Returns an error message, or None. If local rank 0 fails it exits non-zero and the DeepSpeed
    launcher stops the waiting ranks; the deadline covers launchers that do not.
    """
    from llmrl.engine import builtin_models

    names = builtin_models.builtin_names(config)
    if not names:
        return None
    try:
        if local_rank == 0:
            for name in names:
                builtin_models.prepare_builtin(name)
        else:
            builtin_models.wait_until_ready(names, config.timeouts.startup)
    except Exception as err:  # noqa: BLE001 - reported in one line; the launcher then stops the run
        detail = str(err) if isinstance(err, (builtin_models.CacheError, TimeoutError)) else f"{type(err).__name__}: {err}"
        return f"rank {rank}: preparing builtin:{' builtin:'.join(names)} failed: {detail}"
    return None


def _say(message: str, loud: bool) -> None:
    if loud:
        print(f"llmrl: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node_rank = int(os.environ.get("CROSS_RANK", "0"))
    loud = local_rank == 0
    try:
        args = parse_rank_args(argv)
    except ValueError as err:
        _say(f"{err}\n{USAGE}", loud)
        return 2
    from llmrl.engine.config import load_config, world_size_problem
    from llmrl.engine.errors import ConfigError

    try:  # the file's own checks first: a broken config or rank count stops every rank at once
        config = load_config(args.config, args.overrides, check_environment=False, check_plugins=False)
    except ConfigError as err:
        _say(str(err), loud)
        return 2
    problem = world_size_problem(config, world_size)
    if problem:
        _say(problem, loud)
        return 2
    problem = prepare_builtin_models(config, rank, local_rank)
    if problem:
        _say(problem, True)
        return 1
    try:  # then the machine's (model folders, GPUs, plugins), now that builtin models are in place
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        _say(str(err), loud)
        return 2
    if rank == 0:
        from llmrl.engine.client import run_client

        code = run_client(config, lambda: run_script(args))
        exit_file = os.environ.get("LLMRL_EXIT_CODE_FILE")
        if exit_file:
            with open(exit_file, "w") as f:
                f.write(str(code))
        return code
    from llmrl.engine.server import run_server
    from llmrl.plugins import registry

    registry.set_script(path=args.script, module=args.module)
    return run_server(config, rank, local_rank, node_rank)
