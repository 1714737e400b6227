"""``llmrl run``: validate the config, count the ranks, print the exact ``deepspeed`` command, run it.

The run's exit code is the script's: rank 0 writes it to a file the command reads back, so that it
survives the DeepSpeed launcher (which answers Ctrl-C with its own code 1). Ctrl-C gives 130, SIGTERM 143. The
launcher runs supervised (:mod:`llmrl.launch.supervisor`): however this command ends, no rank outlives it. The
run's secret is drawn here and handed to every rank (:mod:`llmrl.engine.transport.secret`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile

from llmrl.engine.processes import RUN_PID_ENV
from llmrl.engine.transport.secret import ENV as SECRET_ENV
from llmrl.engine.transport.secret import new_secret
from llmrl.launch.command import RunOptions, deepspeed_command, deepspeed_executable, hostfile_slots
from llmrl.launch.rank import is_override
from llmrl.launch.supervisor import supervise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--hostfile", help="DeepSpeed hostfile ('hostname slots=N' per line)")
    parser.add_argument("--master_addr", "--master-addr", dest="master_addr", help="address of node 0")
    parser.add_argument("--master_port", "--master-port", dest="master_port", type=int,
                        help="port of rank 0's store (default: a free port on one machine, 29500 with a hostfile)")
    parser.add_argument("--no_ssh", "--no-ssh", dest="no_ssh", action="store_true",
                        help="start this node only (run the same command on every node with its --node_rank)")
    parser.add_argument("--node_rank", "--node-rank", dest="node_rank", type=int, default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the command without running it")
    parser.add_argument("-m", dest="module", help="run a module as the client script (like python -m)")
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="[key.sub=value ...] SCRIPT [script args] (or the script args after -m MODULE)")


def options_from(args: argparse.Namespace) -> RunOptions:
    rest = list(args.rest)
    overrides = []
    while rest and is_override(rest[0]):
        overrides.append(rest.pop(0))
    if args.module:
        script, script_args = None, rest
    else:
        if not rest:
            raise SystemExit("llmrl run: give the client script (or -m MODULE)")
        script, script_args = rest[0], rest[1:]
    return RunOptions(config=args.config, script=script, module=args.module, script_args=script_args,
                      overrides=overrides, hostfile=args.hostfile, master_addr=args.master_addr,
                      master_port=args.master_port, no_ssh=args.no_ssh, node_rank=args.node_rank)


def main(args: argparse.Namespace) -> int:
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError
    from llmrl.engine.transport.rendezvous import free_port

    options = options_from(args)
    try:
        config = load_config(options.config, options.overrides)
    except ConfigError as err:
        print(f"llmrl: {err}", file=sys.stderr)
        return 2
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
    elif not options.master_port:
        options.master_port = free_port()
    if options.hostfile and options.no_ssh and not options.master_addr:
        print("llmrl: --no_ssh with a hostfile needs --master_addr (the address of node 0)", file=sys.stderr)
        return 2
    cmd = deepspeed_command(options, config.world_size, deepspeed_executable())
    print("llmrl: running " + shlex.join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    with tempfile.TemporaryDirectory(prefix="llmrl-run-") as tmp:
        exit_file = os.path.join(tmp, "exit-code")
        env = {**os.environ, "LLMRL_EXIT_CODE_FILE": exit_file, RUN_PID_ENV: str(os.getpid())}
        problem = _give_secret(env, options, tmp)
        if problem:
            print(f"llmrl: {problem}", file=sys.stderr)
            return 2
        if all(llm.devices == "cpu" for llm in config.llms.values()):
            env.setdefault("DS_ACCELERATOR", "cpu")  # the launcher need not probe for (and warn about) GPUs
        code, stopped_by = supervise(cmd, env)
        script_code = None
        if os.path.exists(exit_file):
            with open(exit_file) as f:
                text = f.read().strip()
            if text.lstrip("-").isdigit():
                script_code = int(text)
        if stopped_by == signal.SIGINT and script_code in (None, 128 + signal.SIGTERM):
            # The launcher answers SIGINT by terminating every rank: the script may have been stopped by that
            # SIGTERM before it could report its KeyboardInterrupt.
            return 130
        if stopped_by is not None and stopped_by != signal.SIGINT:
            return 128 + stopped_by
        if script_code is not None:
            return script_code
        return code if code >= 0 else 128 - code


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
