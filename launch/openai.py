"""``llmrl openai``: start a run whose rank 0 serves an OpenAI-compatible API (:mod:`llmrl.engine.openai_api.serve`).

    llmrl openai --config CONFIG [launcher options and key=value overrides] [--host H] [--port P]
                 [--api-key-file F] [--llm NAME] [--rollout-timeout S] [--ready-file F]

The endpoint's own options are taken out of the command line and handed to the endpoint's module; everything else is
``llmrl run``'s (a config, overrides, a hostfile: the endpoint runs wherever and however the config says). The key
comes from ``--api-key-file`` or ``$LLMRL_OPENAI_API_KEY``, never from the command line (which every local user can
read). This module only rewrites the command line; ``llmrl run`` does the rest.
"""

from __future__ import annotations

import argparse

from llmrl.engine.openai_api.serve import add_service_arguments
from llmrl.launch import run
from llmrl.launch.command import split_options

SERVICE_OPTIONS = ("--host", "--port", "--api-key-file", "--llm", "--rollout-timeout", "--ready-file")
MODULE = "llmrl.engine.openai_api.serve"
USAGE = ("llmrl openai --config CONFIG [--host H] [--port P] [--api-key-file F] [--llm NAME] [--rollout-timeout S] "
         "[--ready-file F] [launcher options] [key.sub=value ...]")


def help_parser() -> argparse.ArgumentParser:
    """The parser whose help ``llmrl openai --help`` prints: the endpoint's options, then the launcher's."""
    parser = argparse.ArgumentParser(
        prog="llmrl openai", usage=USAGE,
        description="Start a run whose rank 0 serves an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                    "/v1/models) on the config's LLMs. Options and key.sub=value overrides come in any order.")
    add_service_arguments(parser.add_argument_group("the endpoint"))
    run.add_arguments(parser.add_argument_group("the launcher (as llmrl run)"), script=False)
    return parser


def parse_argv(argv: list[str]) -> run.RunRequest:
    if any(token in ("-h", "--help") for token in argv):
        help_parser().print_help()
        raise SystemExit(0)
    if any(token.split("=", 1)[0] == "--api-key" for token in argv):
        raise SystemExit("llmrl openai: the key is not taken on the command line (every local user can read it): "
                         "give --api-key-file F or $LLMRL_OPENAI_API_KEY")
    rest, service = split_options(argv, SERVICE_OPTIONS, "llmrl openai")
    return run.parse_argv([*rest, "-m", MODULE, *service])


def main(request: run.RunRequest) -> int:
    return run.main(request)
