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
import signal
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
    from llmrl.engine.processes import exit_code

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
        return exit_code(stop.code)
    except KeyboardInterrupt:
        print("llmrl: interrupted (Ctrl-C); stopping the servers", file=sys.stderr, flush=True)
        return 130
    except BaseException:  # noqa: BLE001 - the script's own error, shown as Python would
        traceback.print_exc()
        return 1


def pin_gloo_interface(environ=os.environ) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface on this node's route to the master, unless it is set.

    Without it gloo binds to the address the hostname resolves to, which is often loopback (Debian's
    ``127.0.1.1``, containers, network namespaces): then ranks on other nodes are told to connect to
    127.0.0.1 and the LLM's process group never forms. The interface on the route to ``MASTER_ADDR`` is
    the one the run's stores already use, so it is reachable by the other nodes. NCCL picks its own
    interface (``NCCL_SOCKET_IFNAME``); llmrl leaves that to NCCL. Returns the interface set, or None.
    """
    from llmrl.engine.transport.rendezvous import interface_of, reachable_address

    master = environ.get("MASTER_ADDR")
    if environ.get("GLOO_SOCKET_IFNAME") or not master:
        return None
    interface = interface_of(reachable_address(master))
    if interface:
        environ["GLOO_SOCKET_IFNAME"] = interface
    return interface


def exit_code_file(base: str, rank: int) -> str:
    """Where rank ``rank`` reports its exit code to ``llmrl run`` (``base`` is LLMRL_EXIT_CODE_FILE)."""
    return base if rank == 0 else f"{base}.rank{rank}"


def unreached_file(base: str) -> str:
    """Where rank 0 notes that its script ended before some servers connected (``base`` is LLMRL_EXIT_CODE_FILE)."""
    return f"{base}.unreached"


def report_unreached(ranks: list[int]) -> None:
    """Tell ``llmrl run`` that the script ended before ``ranks`` connected: they were never told to stop, and have
    nothing to finish (written before rank 0's exit code)."""
    base = os.environ.get("LLMRL_EXIT_CODE_FILE")
    if base:
        with open(unreached_file(base), "w") as f:
            f.write(" ".join(map(str, ranks)))


def report_exit(rank: int, code: int) -> None:
    """Tell ``llmrl run`` how this rank ended: the script's exit code on rank 0, 0 for a server that was
    stopped cleanly. A rank that is killed writes nothing, which ``llmrl run`` reports as a failure."""
    base = os.environ.get("LLMRL_EXIT_CODE_FILE")
    if base:
        if rank == 0:  # its process, still to run the atexit handlers (a tracker's finish): `llmrl run` waits for it
            with open(f"{base}.pid", "w") as f:
                f.write(str(os.getpid()))
        with open(exit_code_file(base, rank), "w") as f:
            f.write(str(code))


def loopback_master_warning(environ=os.environ, resolve=None) -> str | None:
    """A warning for a run across nodes whose MASTER_ADDR is a loopback address on this node: rank 0's store
    listens there, where the other nodes cannot reach it (a hostname mapped to 127.0.1.1 in /etc/hosts does
    this). Not an error: several "nodes" on one machine legitimately share 127.0.0.1."""
    import socket

    master = environ.get("MASTER_ADDR")
    nodes = int(environ.get("CROSS_SIZE", "1") or 1)
    if nodes <= 1 or not master:
        return None
    try:
        address = (resolve or socket.gethostbyname)(master)
    except OSError:
        return None  # reported when the store cannot listen there
    if not address.startswith("127."):
        return None
    return (f"warning: the run spans {nodes} nodes but MASTER_ADDR {master!r} is the loopback address {address} on "
            "this node, so rank 0's store listens where other machines cannot reach it; pass --master_addr with "
            "node 0's address on the network the nodes share")


def _client_launcher_gone(why: str) -> None:
    print(f"llmrl: {why}; stopping the run", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the client stops its servers and exits 143


def _server_launcher_gone(why: str) -> None:
    print(f"llmrl: {why}; this rank (pid {os.getpid()}) exits", file=sys.stderr, flush=True)
    os._exit(1)


def _say(message: str, loud: bool) -> None:
    if loud:
        print(f"llmrl: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Become client or server. Rank 0 writes its exit code where ``llmrl run`` reads it back, whatever ended it
    (a Ctrl-C at any moment gives 130)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return _main(argv)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started from a background job of a non-interactive shell, every process ignores SIGINT, and Python then
        # installs no KeyboardInterrupt for it: the Ctrl-C that `llmrl run` forwards would be lost on the client.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 130
    try:
        code = _main(argv)
    except KeyboardInterrupt:
        print("llmrl: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    finally:
        report_exit(0, code)
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node_rank = int(os.environ.get("CROSS_RANK", "0"))
    loud = local_rank == 0
    from llmrl.engine.processes import watch_launchers

    watch_launchers(_client_launcher_gone if rank == 0 else _server_launcher_gone)
    try:
        args = parse_rank_args(argv)
    except ValueError as err:
        _say(f"{err}\n{USAGE}", loud)
        return 2
    from llmrl.engine.config import load_config, world_size_problem
    from llmrl.engine.errors import ConfigError
    from llmrl.launch.prepare import prepare_builtin_models

    try:  # the file's own checks first: a broken config or rank count stops every rank at once
        config = load_config(args.config, args.overrides, check_environment=False, check_plugins=False)
    except ConfigError as err:
        _say(str(err), loud)
        return 2
    problem = world_size_problem(config, world_size)
    if problem:
        _say(problem, loud)
        return 2
    problem = prepare_builtin_models(config, rank=rank, local_rank=local_rank)
    if problem:
        _say(problem, True)
        return 1
    try:  # then the machine's (model folders, GPUs, plugins), now that builtin models are in place
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        _say(str(err), loud)
        return 2
    if rank == 0:
        from llmrl.engine.client.hosting import run_client

        warning = loopback_master_warning()
        if warning:
            _say(warning, True)
        return run_client(config, lambda: run_script(args), on_unreached=report_unreached)
    from llmrl.engine.server.serve import run_server
    from llmrl.plugins import registry

    pin_gloo_interface()
    registry.set_script(path=args.script, module=args.module)
    return run_server(config, rank, local_rank, node_rank, on_exit=lambda code: report_exit(rank, code))
