"""Rank 0's script of an OpenAI-compatible endpoint: ``llmrl openai --config CONFIG [--host H] [--port P]
[--api-key-file F] [--llm NAME] [--ready-file F]`` (or ``llmrl run --config CONFIG -m llmrl.engine.openai_api.serve
...``).

It creates the run's Caller, serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on
``host:port`` (127.0.0.1:8000 by default) until Ctrl-C (the run exits 130) or SIGTERM (143), and prints the lines an
OpenAI client needs: ``OPENAI_BASE_URL``, and ``OPENAI_API_KEY`` when it drew the key. The key is the first line of
``--api-key-file``, else ``$LLMRL_OPENAI_API_KEY``, else one drawn now. ``--ready-file`` names a file, which must not
exist yet, written with the base URL once the endpoint answers. Without ``--llm`` every LLM of the config is served,
by name. Calls are captured by rollout id in this process; a script that trains on them runs the endpoint itself
(:func:`llmrl.openai_endpoint`), and this command serves (evaluation, an agent framework's smoke test).

This module starts and stops the endpoint; the calls are :mod:`llmrl.engine.openai_api.service`'s.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

KEY_ENV = "LLMRL_OPENAI_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="llmrl openai", description=__doc__.splitlines()[0])
    add_service_arguments(parser)
    return parser.parse_args(argv)


def add_service_arguments(parser) -> None:
    """The endpoint's own options (``llmrl openai`` takes them out of its command line and hands them here)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--api-key-file", default=None,
                        help=f"a file whose first line is the key clients send as a Bearer token; else ${KEY_ENV}, "
                             "else a key drawn now")
    parser.add_argument("--llm", default=None, help="the LLM to serve (default: every LLM of the config, by name)")
    parser.add_argument("--rollout-timeout", type=float, default=600.0,
                        help="seconds a captured rollout is kept after its last call")
    parser.add_argument("--ready-file", default=None, help="write the base URL here once serving")


def endpoint_key(args: argparse.Namespace, environ) -> tuple[str, str]:
    """``(key, where it came from)``: ``--api-key-file``'s first line, else ``$LLMRL_OPENAI_API_KEY``, else drawn
    now. ValueError for a file that cannot be read or holds no key."""
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: {err.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: its first line is empty (write the key there)")
        return key, f"--api-key-file {args.api_key_file}"
    if environ.get(KEY_ENV):
        return environ[KEY_ENV], f"${KEY_ENV}"
    return f"llmrl-{secrets.token_urlsafe(24)}", "drawn"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        key, source = endpoint_key(args, os.environ)
    except ValueError as err:
        print(f"llmrl openai: {err}", file=sys.stderr)
        return 2
    if args.ready_file and os.path.lexists(args.ready_file):
        print(f"llmrl openai: --ready-file {args.ready_file} exists; it is not overwritten: remove it, or name a file "
              "that does not exist yet", file=sys.stderr)
        return 2
    from llmrl import Caller
    from llmrl.engine.openai_api.endpoint import openai_endpoint
    from llmrl.engine.tinker.serve import serve_until_stopped

    with Caller() as caller:
        endpoint = openai_endpoint(caller, host=args.host, port=args.port, api_key=key, llm=args.llm,
                                   rollout_timeout=args.rollout_timeout)
        told = f"  export OPENAI_API_KEY={key}" if source == "drawn" else f"  # OPENAI_API_KEY: the key of {source}"
        print(f"llmrl openai: serving {', '.join(endpoint.service.served())} at {endpoint.base_url}\n"
              f"  export OPENAI_BASE_URL={endpoint.base_url}\n{told}", flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(endpoint.base_url)
            os.replace(args.ready_file + ".tmp", args.ready_file)
        serve_until_stopped(endpoint.close, "llmrl openai")
    return 0


if __name__ == "__main__":
    sys.exit(main())
