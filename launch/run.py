"""``llmrl run``: validate the config, count the ranks, prepare the config's ``builtin:`` models, print the
exact ``deepspeed`` command, run it.

The run's exit code is the script's: rank 0 writes it to a file the command reads back, so that it
survives the DeepSpeed launcher (which answers Ctrl-C with its own code 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile

from llmrl.launch.command import RunOptions, deepspeed_command, deepspeed_executable, hostfile_slots
from llmrl.launch.rank import is_override


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
    from llmrl.engine.rendezvous import free_port

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
    if args.dry_run:
        print("llmrl: running " + shlex.join(cmd), file=sys.stderr, flush=True)
        return 0
    problem = prepare_builtin_models(config)
    if problem:
        print(f"llmrl: {problem}", file=sys.stderr)
        return 1
    print("llmrl: running " + shlex.join(cmd), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="llmrl-run-") as tmp:
        exit_file = os.path.join(tmp, "exit-code")
        env = {**os.environ, "LLMRL_EXIT_CODE_FILE": exit_file}
        if all(llm.devices == "cpu" for llm in config.llms.values()):
            env.setdefault("DS_ACCELERATOR", "cpu")  # the launcher need not probe for (and warn about) GPUs
        process = subprocess.Popen(cmd, env=env)
        code, interrupted = wait_forwarding_ctrl_c(process)
        script_code = None
        if os.path.exists(exit_file):
            with open(exit_file) as f:
                text = f.read().strip()
            if text.lstrip("-").isdigit():
                script_code = int(text)
        if interrupted and script_code in (None, 128 + signal.SIGTERM):
            # Ctrl-C reached the launcher too, which terminates every rank at once: the script may
            # have been stopped by that SIGTERM before it could report its KeyboardInterrupt.
            return 130
        if script_code is not None:
            return script_code
        return code if code >= 0 else 128 - code


def prepare_builtin_models(config) -> str | None:
    """Convert, verify and install the config's ``builtin:`` models in this process, before the launcher
    starts (so before any process group exists); an error message, or None."""
    from llmrl.engine import builtin_models

    names = builtin_models.builtin_names(config)
    try:
        for name in names:
            builtin_models.prepare_builtin(name)
    except Exception as err:  # noqa: BLE001 - one clear line, nothing launched
        detail = str(err) if isinstance(err, builtin_models.CacheError) else f"{type(err).__name__}: {err}"
        return f"preparing builtin:{name} failed: {detail}"
    return None


def wait_forwarding_ctrl_c(process: subprocess.Popen, grace: float = 3.0) -> tuple[int, bool]:
    """Wait for the launcher; on Ctrl-C give it ``grace`` seconds to stop the ranks itself.

    A terminal's Ctrl-C reaches the whole process group (this command, the launcher, every rank);
    forwarding it at once would interrupt the launcher's own cleanup. A SIGINT sent to this command
    alone is forwarded after the grace period. Returns (the launcher's exit code, interrupted).
    """
    interrupted = False
    while True:
        try:
            if interrupted:
                try:
                    return process.wait(grace), True
                except subprocess.TimeoutExpired:
                    process.send_signal(signal.SIGINT)
            return process.wait(), interrupted
        except KeyboardInterrupt:
            interrupted = True
