"""Rank 0's script of a Tinker service: ``llmrl tinker --config CONFIG [--host H] [--port P] [--api-key K]`` (or
``llmrl run --config CONFIG -m llmrl.engine.tinker.serve ...``).

It creates the run's Caller, serves Tinker's REST API on ``host:port`` (127.0.0.1:8000 by default) until Ctrl-C (the
run exits 130) or SIGTERM (143), and prints the lines a Tinker script needs: ``TINKER_BASE_URL`` and
``TINKER_API_KEY``. The key is ``--api-key``, else the ``TINKER_API_KEY`` of this environment, else one drawn now
(it must start with ``tml-``, as the SDK checks). ``--ready-file`` names a file, which must not exist yet, written
once the service answers (for scripts and tests that start it in the background). The config's first LLM (or
``--llm``) is the base model: it must hold a LoRA adapter, and train with ZeRO 0 in float32 (training clients are
adapters created at run time).

This module starts and stops the service; the calls are :mod:`llmrl.engine.tinker.service`'s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmrl tinker", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--api-key", default=None, help="the key clients send (must start with tml-)")
    parser.add_argument("--llm", default=None, help="the LLM to serve (default: the config's first)")
    parser.add_argument("--save-dir", default="tinker-checkpoints", help="where save_weights writes checkpoints")
    parser.add_argument("--ready-file", default=None, help="write the base URL here once serving")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    key = args.api_key or os.environ.get("TINKER_API_KEY") or f"tml-{secrets.token_urlsafe(24)}"
    if not key.startswith("tml-"):
        print("llmrl tinker: the API key must start with 'tml-' (the tinker SDK refuses others)", file=sys.stderr)
        return 2
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
        print(f"llmrl tinker: serving {service.llm!r} ({service.model_name}) at {url}\n"
              f"  export TINKER_BASE_URL={url}\n  export TINKER_API_KEY={key}", flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(args.ready_file + ".tmp", args.ready_file)
        try:  # until Ctrl-C (the run ends with 130) or SIGTERM (143)
            threading.Event().wait()
        finally:
            print("llmrl tinker: stopping", file=sys.stderr, flush=True)
            server.shutdown()
            service.futures.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
