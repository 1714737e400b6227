"""Rank 0's script of a Tinker service: ``llmrl tinker --config CONFIG [--host H] [--port P] [--api-key-file F]``
(or ``llmrl run --config CONFIG -m llmrl.engine.tinker.serve ...``).

It creates the run's Caller, serves Tinker's REST API on ``host:port`` (127.0.0.1:8000 by default) until Ctrl-C (the
run exits 130) or SIGTERM (143), and prints the lines a Tinker script needs: ``TINKER_BASE_URL``, and
``TINKER_API_KEY`` when it drew the key. The key is the first line of ``--api-key-file``, else ``--api-key`` (which
every local user can read in the processes' command lines: it is warned about; ``llmrl tinker`` hands it to the ranks
in their environment), else the ``TINKER_API_KEY`` of this environment, else one drawn now (it must start with
``tml-``, as the SDK checks). ``--ready-file`` names a file, which must not exist yet, written once the service
answers (for scripts and tests that start it in the background). The config's first LLM (or ``--llm``) is the base
model: it must hold a LoRA adapter, and train with ZeRO 0-3 in float32 or bfloat16 (training clients are adapters
created at run time).

This module starts and stops the service; the calls are :mod:`llmrl.engine.tinker.service`'s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time

KEY_ENV = "TINKER_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmrl tinker", description=__doc__.splitlines()[0])
    add_service_arguments(parser)
    return parser.parse_args(argv)


def add_service_arguments(parser) -> None:
    """The service's own options (``llmrl tinker`` takes them out of its command line and hands them here)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--api-key-file", default=None,
                        help="a file whose first line is the key clients send (must start with tml-); else "
                             f"${KEY_ENV}, else a key drawn now")
    parser.add_argument("--api-key", default=None,
                        help="the key itself: other local users can read it in the command line (give "
                             f"--api-key-file or ${KEY_ENV} instead)")
    parser.add_argument("--llm", default=None, help="the LLM to serve (default: the config's first)")
    parser.add_argument("--save-dir", default="tinker-checkpoints", help="where save_weights writes checkpoints")
    parser.add_argument("--ready-file", default=None, help="write the base URL here once serving")


def service_key(args: argparse.Namespace, environ) -> tuple[str, str]:
    """``(key, where it came from)``: ``--api-key-file``'s first line, else ``--api-key``, else ``$TINKER_API_KEY``,
    else drawn now. ValueError for a file that cannot be read, two sources given, or a key without ``tml-``."""
    if args.api_key_file and args.api_key:
        raise ValueError("give the key once: --api-key-file or --api-key, not both")
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key, source = f.readline().strip(), f"--api-key-file {args.api_key_file}"
        except OSError as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: {err.strerror}") from None
    elif args.api_key:
        key, source = args.api_key, "--api-key"
    elif environ.get(KEY_ENV):
        key, source = environ[KEY_ENV], f"${KEY_ENV}"
    else:
        return f"tml-{secrets.token_urlsafe(24)}", "drawn"
    if not key.startswith("tml-"):
        raise ValueError(f"the API key of {source} must start with 'tml-' (the tinker SDK refuses others)")
    return key, source


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        key, source = service_key(args, os.environ)
    except ValueError as err:
        print(f"llmrl tinker: {err}", file=sys.stderr)
        return 2
    if source == "--api-key":
        print("llmrl tinker: warning: --api-key puts the key in this process's command line, which every user of "
              f"this machine can read: give --api-key-file F or ${KEY_ENV} instead", file=sys.stderr)
    if args.ready_file and os.path.lexists(args.ready_file):
        print(f"llmrl tinker: --ready-file {args.ready_file} exists; it is not overwritten: remove it, or name a file "
              "that does not exist yet", file=sys.stderr)
        return 2
    from llmrl import Caller
    from llmrl.engine.tinker.http import make_server
    from llmrl.engine.tinker.service import TinkerService

    with Caller() as caller:
        service = TinkerService(caller, args.llm, args.save_dir)
        server = make_server(service, args.host, args.port, key)
        url = f"http://{server.server_address[0]}:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, name="tinker-http", daemon=True)
        thread.start()
        told = f"  export {KEY_ENV}={key}" if source == "drawn" else f"  # {KEY_ENV}: the key of {source}"
        print(f"llmrl tinker: serving {service.llm!r} ({service.model_name}) at {url}\n"
              f"  export TINKER_BASE_URL={url}\n{told}", flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(args.ready_file + ".tmp", args.ready_file)
        serve_until_stopped(lambda: (server.shutdown(), service.futures.close()))
    return 0


def serve_until_stopped(clean_up, name: str = "llmrl tinker") -> None:
    """Sleep until Ctrl-C (the run ends with 130) or SIGTERM (143), run ``clean_up()`` whole, and raise the first
    signal's exception (KeyboardInterrupt, or SystemExit(143) as rank 0's host raises for SIGTERM). Ctrl-C reaches the
    whole process group and DeepSpeed's launcher then sends SIGTERM too: only the first signal counts. A second one
    raised inside an ``Event``'s wait left its lock broken ("release unlocked lock": the run ended with 1), and one
    raised in the clean-up cut it short. Once a signal came, SIGINT and SIGTERM stay ignored after the clean-up: the
    process is ending, and a second signal arriving late (while the interpreter shuts down, when Python has put the
    default handlers back) would kill it by that signal instead of the first one's exit code. Returning by an
    exception of ``clean_up`` without a signal puts the previous handlers back."""
    first: list[int] = []

    def on_signal(number, frame):
        if first:  # the run is already stopping
            return
        first.append(number)
        if number == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + number)

    previous = {number: signal.signal(number, on_signal) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            time.sleep(3600)
    finally:
        try:
            print(f"{name}: stopping", file=sys.stderr, flush=True)
            clean_up()
        finally:
            for number, handler in previous.items():
                signal.signal(number, signal.SIG_IGN if first else handler)


if __name__ == "__main__":
    sys.exit(main())
