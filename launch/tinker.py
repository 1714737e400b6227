"""``llmrl tinker``: start a run whose rank 0 serves Tinker's REST API (:mod:`llmrl.engine.tinker.serve`).

    llmrl tinker --config CONFIG [launcher options and key=value overrides] [--host H] [--port P]
                 [--api-key-file F] [--llm NAME] [--save-dir D] [--ready-file F]

The service's own options are taken out of the command line and handed to the service module; everything else is
``llmrl run``'s (a config, overrides, a hostfile: the service runs wherever and however the config says). The key
comes from ``--api-key-file`` or ``$TINKER_API_KEY`` (:mod:`llmrl.engine.tinker.serve`); ``--api-key K`` still
works, with a warning (this command's own line shows it), and is handed to the ranks in their environment, never on
their command lines. This module only rewrites the command line; ``llmrl run`` does the rest.
"""

from __future__ import annotations

import argparse
import sys

from llmrl.engine.tinker.serve import KEY_ENV, add_service_arguments
from llmrl.launch import run
from llmrl.launch.command import split_options

SERVICE_OPTIONS = ("--host", "--port", "--api-key", "--api-key-file", "--llm", "--save-dir", "--ready-file")
MODULE = "llmrl.engine.tinker.serve"


def split_service_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(run's arguments, the service's)``: each service option and its value moves to the second list."""
    return split_options(argv, SERVICE_OPTIONS, "llmrl tinker")


def take_key(service: list[str]) -> tuple[list[str], str | None]:
    """``(the service's options without --api-key, its value)``: the key goes to the ranks' environment, not their
    command lines (which every local user can read in ``/proc``)."""
    kept, key, k = [], None, 0
    while k < len(service):
        name, eq, value = service[k].partition("=")
        if name == "--api-key":
            key = value if eq else service[k + 1]
            k += 1 if eq else 2
        else:
            kept.append(service[k])
            k += 1
    return kept, key


def help_parser() -> argparse.ArgumentParser:
    """The parser whose help ``llmrl tinker --help`` prints: the service's options, then the launcher's (``llmrl
    run``'s, less the script: the service is the script)."""
    parser = argparse.ArgumentParser(
        prog="llmrl tinker", usage=USAGE,
        description="Start a run whose rank 0 serves Tinker's REST API (the tinker SDK and tinker-cookbook recipes "
                    "train on the config's LLM). Options and key.sub=value overrides come in any order.")
    add_service_arguments(parser.add_argument_group("the service"))
    launcher = parser.add_argument_group("the launcher (as llmrl run)")
    run.add_arguments(launcher, script=False)
    return parser


USAGE = ("llmrl tinker --config CONFIG [--host H] [--port P] [--api-key-file F] [--llm NAME] [--save-dir D] "
         "[--ready-file F] [launcher options] [key.sub=value ...]")


def parse_argv(argv: list[str]) -> run.RunRequest:
    if any(token in ("-h", "--help") for token in argv):
        help_parser().print_help()
        raise SystemExit(0)
    rest, service = split_service_options(argv)
    service, key = take_key(service)
    if key is not None and any(token.split("=", 1)[0] == "--api-key-file" for token in service):
        raise SystemExit("llmrl tinker: give the key once: --api-key-file or --api-key, not both")
    request = run.parse_argv([*rest, "-m", MODULE, *service])
    if key is not None:
        print("llmrl tinker: warning: --api-key shows the key in this command's line, which every user of this "
              f"machine can read (the ranks get it in their environment): give --api-key-file F or ${KEY_ENV} "
              "instead", file=sys.stderr)
        request.env[KEY_ENV] = key
    return request


def main(request: run.RunRequest) -> int:
    return run.main(request)
