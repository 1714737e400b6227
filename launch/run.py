"""``llmrl run``: read the command line, validate the config, count the ranks, print the exact command, run it: the
``deepspeed`` command, or, where this machine starts the ranks itself, the DeepSpeed launcher command that one
executes (:func:`llmrl.launch.command.node_launcher_command`).

The command line is ``llmrl run [launcher options and key=value overrides, in any order] (SCRIPT | -m
MODULE) [script args]``. It is read in full (:func:`parse_argv`, a pure function) before anything
starts: an unknown option before the script is an error, and everything after the script is the
script's own. The config's ``builtin:`` models are prepared here, before the launcher starts
(:mod:`llmrl.launch.prepare`).

The run's exit code is the script's: rank 0 writes it to a file the command reads back, so that it
survives the DeepSpeed launcher (which answers Ctrl-C with its own code 1); Ctrl-C gives 130, SIGTERM 143.
Server ranks stopped cleanly write 0 to a file of their own; on a node without rank 0, a rank that wrote
nothing (killed, or its DeepSpeed launcher was) makes the command exit 1, since DeepSpeed's launcher
reports a launcher killed by a signal as success. The launcher runs supervised
(:mod:`llmrl.launch.supervisor`): however this command ends, no rank outlives it. The run's secret is drawn
here and handed to every rank (:mod:`llmrl.engine.transport.secret`).

This module does not build the command (:mod:`llmrl.launch.command` does) nor run ranks.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import signal
import sys
import tempfile
from dataclasses import dataclass, field

from llmrl.engine.processes import RUN_PID_ENV
from llmrl.engine.transport.secret import ENV as SECRET_ENV
from llmrl.engine.transport.secret import new_secret
from llmrl.launch.command import (
    RunOptions,
    deepspeed_command,
    deepspeed_executable,
    hostfile_slots,
    node_commands,
    node_launcher_command,
    node_ranks,
)
from llmrl.launch.prepare import prepare_builtin_models
from llmrl.launch.rank import exit_code_file, is_override, unreached_file
from llmrl.launch.supervisor import supervise

USAGE = ("llmrl run --config CONFIG [--hostfile H] [--no_ssh --node_rank R] [--master_addr A] [--master_port P] "
         "[--dry-run] [key.sub=value ...] (SCRIPT | -m MODULE) [script args]")


def add_arguments(parser: argparse.ArgumentParser, script: bool = True) -> None:
    """The launcher's options (every one takes a value except the flags --no_ssh and --dry-run); without ``script``,
    not ``-m MODULE`` (``llmrl tinker``: the service is the script)."""
    parser.add_argument("--config", help="the run's YAML config (required)")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile ('hostname slots=N' per line)")
    parser.add_argument("--master_addr", "--master-addr", dest="master_addr", help="address of node 0")
    parser.add_argument("--master_port", "--master-port", dest="master_port", type=int,
                        help="port of rank 0's store (default: a free port on one machine, 29500 with a hostfile)")
    parser.add_argument("--no_ssh", "--no-ssh", dest="no_ssh", action="store_true",
                        help="start this node only (run the same command on every node with its --node_rank)")
    parser.add_argument("--node_rank", "--node-rank", dest="node_rank", type=int, default=None,
                        help="with --no_ssh: which line of the hostfile this node is (0 = the node of rank 0)")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="check everything and print the exact command of every node, without starting anything")
    if script:
        parser.add_argument("-m", dest="module", help="run a module as the client script (like python -m)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmrl run", usage=USAGE,
        description="Launch a run: rank 0 runs SCRIPT, the other ranks serve the config's LLMs. Launcher options "
                    "and key.sub=value overrides come before the script, in any order; everything after the "
                    "script is the script's.")
    add_arguments(parser)
    return parser


@dataclass
class RunRequest:
    """A fully understood ``llmrl run`` command line."""

    options: RunOptions
    dry_run: bool = False
    env: dict[str, str] = field(default_factory=dict)  # for the ranks' environment, never their command lines


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str], list[str]]:
    """Split ``argv`` into (launcher options, overrides, the script and its arguments); pure.

    Launcher options and overrides may come in any order before the script; ``-m MODULE`` also ends
    the launcher's part. Raises ValueError for an unknown option or an option missing its value.
    """
    takes_value, primary = {}, []
    for action in parser._actions:
        for name in action.option_strings:
            takes_value[name] = action.nargs != 0
        primary.append(action.option_strings[-1] if action.option_strings[-1] == "-m" else action.option_strings[0])
    launcher, overrides = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if token == "-m" or (name == "-m" and eq):
            if eq:
                return launcher + ["-m", value], overrides, argv[i + 1:]
            if i + 1 >= len(argv):
                raise ValueError("-m needs a module name")
            return launcher + ["-m", argv[i + 1]], overrides, argv[i + 2:]
        if token.startswith("-"):
            if name not in takes_value:
                close = difflib.get_close_matches(name, list(takes_value), n=1)
                same = [p for p in primary if close and p.replace("-", "_") == close[0].replace("-", "_")]
                hint = f"; did you mean {(same or close)[0]}?" if close else ""  # the documented spelling
                raise ValueError(f"unknown option {name!r} before the script{hint} (options: {', '.join(primary)}; "
                                 "the script's own options go after the script)")
            if not takes_value[name]:
                if eq:
                    raise ValueError(f"{name} takes no value (got {token!r})")
                launcher.append(name)
            elif eq:
                launcher += [name, value]
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                launcher += [name, argv[i + 1]]
                i += 1
        elif is_override(token):
            overrides.append(token)
        else:
            return launcher, overrides, argv[i:]
        i += 1
    return launcher, overrides, []


def parse_argv(argv: list[str]) -> RunRequest:
    """Understand the whole command line, or exit 2 with a message (nothing is started either way)."""
    parser = build_parser()
    if any(token in ("-h", "--help") for token in _launcher_part(argv, parser)):
        parser.print_help()
        raise SystemExit(0)
    try:
        launcher, overrides, rest = split_argv(argv, parser)
    except ValueError as err:
        parser.error(str(err))
    args = parser.parse_args(launcher)
    if not args.config:
        parser.error("--config CONFIG is required")
    if args.module:
        script, script_args = None, rest
    elif not rest:
        parser.error("give the client script (or -m MODULE) after the options")
    else:
        script, script_args = rest[0], rest[1:]
    if args.node_rank is not None and not args.no_ssh:
        parser.error("--node_rank goes with --no_ssh (each node started by hand); without --no_ssh, node 0 starts "
                     "every node over ssh")
    options = RunOptions(config=args.config, script=script, module=args.module, script_args=script_args,
                         overrides=overrides, hostfile=args.hostfile, master_addr=args.master_addr,
                         master_port=args.master_port, no_ssh=args.no_ssh, node_rank=args.node_rank)
    return RunRequest(options=options, dry_run=args.dry_run)


def _launcher_part(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The tokens before the script (for -h), tolerant of errors the full parse reports properly."""
    try:
        return split_argv(argv, parser)[0]
    except ValueError:
        return []


def main(request: RunRequest) -> int:
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError
    from llmrl.engine.transport.rendezvous import free_port

    options = request.options
    if options.script and not os.path.isfile(options.script):
        print(f"llmrl: the script {options.script} is not a file (looked in {os.getcwd()}); give its path, or "
              "-m MODULE for a module", file=sys.stderr)
        return 2
    try:
        # without a hostfile every rank runs here: `devices: auto` is checked against this machine's GPUs now
        config = load_config(options.config, options.overrides, single_node=True if not options.hostfile else None)
    except ConfigError as err:
        print(f"llmrl: {err}", file=sys.stderr)
        return 2
    slots = None
    if options.hostfile:
        try:
            with open(options.hostfile) as f:
                slots = hostfile_slots(f.read())
        except (OSError, ValueError) as err:
            print(f"llmrl: hostfile {options.hostfile}: {err}", file=sys.stderr)
            return 2
        if sum(slots.values()) != config.world_size:
            print(f"llmrl: the hostfile offers {sum(slots.values())} slots but the config needs {config.world_size} "
                  f"ranks (1 client + {config.num_server_ranks} servers); edit the slots", file=sys.stderr)
            return 2
        if request.env and len(slots) > 1 and not options.no_ssh:
            print(f"llmrl: {', '.join(sorted(request.env))} would reach the other nodes on pdsh's command line, "
                  "which every user can read: start each node with --no_ssh, or give it another way (llmrl tinker: "
                  "--api-key-file F, a file on rank 0's node)", file=sys.stderr)
            return 2
        if options.no_ssh:
            if not options.master_addr:
                print("llmrl: --no_ssh with a hostfile needs --master_addr (the address of node 0)", file=sys.stderr)
                return 2
            try:
                node_ranks(slots, options.node_rank or 0)
            except ValueError as err:
                print(f"llmrl: --node_rank: {err}", file=sys.stderr)
                return 2
    elif not options.master_port:
        options.master_port = free_port()
    executable = deepspeed_executable()
    cmd = deepspeed_command(options, config.world_size, executable)
    if request.dry_run:
        print_dry_run(options, config.world_size, slots, cmd, executable)
        return 0
    problem = prepare_builtin_models(config)
    if problem:
        print(f"llmrl: {problem}", file=sys.stderr)
        return 1
    cmd = node_launcher_command(options, config.world_size, slots) or cmd  # the runner itself only for ssh
    print("llmrl: running " + shlex.join(cmd), file=sys.stderr, flush=True)
    local = local_ranks(options, config.world_size, slots)
    with tempfile.TemporaryDirectory(prefix="llmrl-run-") as tmp:
        exit_file = os.path.join(tmp, "exit-code")
        env = {**os.environ, **request.env, "LLMRL_EXIT_CODE_FILE": exit_file, RUN_PID_ENV: str(os.getpid())}
        problem = _give_secret(env, options, tmp)
        if problem:
            print(f"llmrl: {problem}", file=sys.stderr)
            return 2
        if all(llm.devices == "cpu" for llm in config.llms.values()):
            env.setdefault("DS_ACCELERATOR", "cpu")  # the launcher need not probe for (and warn about) GPUs
        watched = 0 in local  # rank 0 runs here: this node can tell when the script ended
        code, stopped_by = supervise(cmd, env, script_ended=(lambda: client_ended(exit_file)) if watched else None,
                                     servers_unreached=lambda: os.path.exists(unreached_file(exit_file)))
        reported = {rank: read_exit_code(exit_code_file(exit_file, rank)) for rank in local}
    return run_exit_code(code, stopped_by, reported)


def local_ranks(options: RunOptions, world_size: int, slots: dict[str, int] | None) -> list[int]:
    """The global ranks this command starts on this machine whose exit it can check (none when a hostfile
    run starts the nodes over ssh: their ranks report on their own machines)."""
    if slots is None:
        return list(range(world_size))
    if options.no_ssh:
        return list(node_ranks(slots, options.node_rank or 0))
    return []


def client_ended(exit_file: str) -> bool:
    """Whether rank 0 has reported its exit code and its process has ended (its atexit handlers done)."""
    import psutil

    if not os.path.exists(exit_file):
        return False
    pid = read_exit_code(f"{exit_file}.pid")
    try:
        return pid is None or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def read_exit_code(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


def run_exit_code(launcher_code: int, stopped_by: int | None, reported: dict[int, int | None]) -> int:
    """The command's exit code from the launcher's, the signal that stopped the run (if any) and what this
    node's ranks reported; pure.

    Ctrl-C: 130; SIGTERM (or SIGHUP): 128 + the signal. With rank 0 on this node: the script's code, unless a
    server rank here was killed by a signal (the launcher's code says which) and the launcher then stopped the
    script: 128 + that signal.
    Otherwise the launcher's code when non-zero (128 + the signal when it reports a rank killed by one, or when it
    was killed by one itself: the ranks of this node that did not report a clean stop are named), else 1 if a rank
    of this node did not report a clean stop (DeepSpeed's runner, where one ran, reports its launcher's death by a
    signal as success), else 0.
    """
    script_code = reported.get(0)
    if stopped_by == signal.SIGINT and script_code in (None, 128 + signal.SIGTERM):
        # The launcher answers SIGINT by terminating every rank: the script may have been stopped by that
        # SIGTERM before it could report its KeyboardInterrupt.
        return 130
    if stopped_by is not None and stopped_by != signal.SIGINT:
        return 128 + stopped_by
    killer = 256 - launcher_code if 192 < launcher_code < 256 else None  # DeepSpeed's launcher exits with a
    # killed rank's negative code (256 - the signal); without a local rank unreported, a code is a code
    servers_unreported = sorted(rank for rank, code in reported.items() if rank != 0 and code is None)
    if killer is not None and script_code == 128 + signal.SIGTERM and servers_unreported:
        print(f"llmrl: rank(s) {', '.join(map(str, servers_unreported))} of this node died by {_signal_name(killer)} "
              f"without a report, and DeepSpeed's launcher then stopped the script (SIGTERM); the run ends with "
              f"{128 + killer}", file=sys.stderr)
        return 128 + killer
    if script_code is not None:
        return script_code
    if killer is not None and any(code is None for code in reported.values()):
        print(f"llmrl: a rank of this node was killed by {_signal_name(killer)} before it could report (the "
              f"script's exit code is unknown); the run ends with {128 + killer}", file=sys.stderr)
        return 128 + killer
    unclean = sorted(rank for rank, code in reported.items() if code != 0)
    if launcher_code < 0 and unclean:  # the per-node launcher `llmrl run` started was itself killed by a signal
        print(f"llmrl: DeepSpeed's launcher of this node was killed by {_signal_name(-launcher_code)}; rank(s) "
              f"{', '.join(map(str, unclean))} of this node ended without a clean stop", file=sys.stderr)
    if launcher_code != 0:
        return launcher_code if launcher_code > 0 else 128 - launcher_code
    if unclean:
        print(f"llmrl: rank(s) {', '.join(map(str, unclean))} of this node ended without a clean stop (killed, "
              "or their DeepSpeed launcher was); see the other nodes' output for the cause", file=sys.stderr)
        return 1
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def print_dry_run(options: RunOptions, world_size: int, slots: dict[str, int] | None, cmd: list[str],
                  executable: str) -> None:
    """Print what would run on stdout: one command per line, each after a ``#`` line saying where it runs
    (so the output reads as a shell script). Starts nothing."""
    def note(text: str) -> None:
        print(f"# {text}")

    if slots is None:
        note(f"llmrl dry run: this machine would start all {world_size} ranks as this command does (llmrl run starts "
             "the DeepSpeed launcher it runs directly):")
        print(shlex.join(cmd))
        return
    if not options.no_ssh:
        note(f"llmrl dry run: this machine would start all {len(slots)} nodes over ssh (pdsh) with:")
        print(shlex.join(cmd))
        note("or, without ssh, run on each node its own line (same hostfile and files on every node):")
    else:
        note(f"llmrl dry run: the run spans {len(slots)} node(s); run on each node its own line:")
    for node in node_commands(options, slots, executable):
        this = " (this command)" if options.no_ssh and node.node_rank == (options.node_rank or 0) else ""
        roles = f"ranks {node.ranks.start}-{node.ranks.stop - 1}" if len(node.ranks) > 1 else f"rank {node.ranks.start}"
        note(f"node {node.node_rank}, {node.host}, {roles}{', rank 0 runs the script' if node.node_rank == 0 else ''}"
             f"{this}:")
        print(shlex.join(node.argv))


def _give_secret(env: dict, options: RunOptions, tmp: str) -> str | None:
    """Put the run's secret where every rank finds it: this node's ranks inherit the environment; nodes started
    over ssh get it through DeepSpeed's environment file; nodes started one by one need the user's own."""
    if env.get(SECRET_ENV):
        return None
    several_nodes = bool(options.hostfile) and _hostfile_nodes(options.hostfile) > 1
    if several_nodes and options.no_ssh:
        return (f"a run whose nodes are started one by one (--no_ssh) needs the same {SECRET_ENV} on every node: "
                f"export {SECRET_ENV}=$(python -c \"import secrets; print(secrets.token_hex(32))\") once and pass "
                "the same value to every node's command")
    env[SECRET_ENV] = new_secret()
    if several_nodes:
        env_file = os.path.join(tmp, "deepspeed_env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{SECRET_ENV}={env[SECRET_ENV]}\n")
        env["DS_ENV_FILE"] = env_file  # DeepSpeed's runner exports what it lists to every node
    return None


def _hostfile_nodes(path: str) -> int:
    with open(path) as f:
        return len(hostfile_slots(f.read()))
