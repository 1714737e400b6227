"""``llmrl tinker``: start a run whose rank 0 serves Tinker's REST API (:mod:`llmrl.engine.tinker.serve`).

    llmrl tinker --config CONFIG [launcher options and key=value overrides] [--host H] [--port P] [--api-key K]
                 [--llm NAME] [--save-dir D] [--ready-file F]

The service's own options are taken out of the command line and handed to the service module; everything else is
``llmrl run``'s (a config, overrides, a hostfile: the service runs wherever and however the config says). This
module only rewrites the command line; ``llmrl run`` does the rest.
"""

from __future__ import annotations

from llmrl.launch import run

SERVICE_OPTIONS = ("--host", "--port", "--api-key", "--llm", "--save-dir", "--ready-file")
MODULE = "llmrl.engine.tinker.serve"


def split_service_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(run's arguments, the service's)``: each service option and its value (``--port 8000`` or
    ``--port=8000``) moves to the second list."""
    rest, service, k = [], [], 0
    while k < len(argv):
        token = argv[k]
        name = token.split("=", 1)[0]
        if name in SERVICE_OPTIONS:
            if "=" in token:
                service.append(token)
            elif k + 1 < len(argv):
                service += [token, argv[k + 1]]
                k += 1
            else:
                raise SystemExit(f"llmrl tinker: {token} needs a value")
        else:
            rest.append(token)
        k += 1
    return rest, service


def parse_argv(argv: list[str]) -> run.RunRequest:
    rest, service = split_service_options(argv)
    return run.parse_argv([*rest, "-m", MODULE, *service])


def main(request: run.RunRequest) -> int:
    return run.main(request)
