"""The ``llmrl`` command: one verb per module (run, eval, tinker, openai, validate, env, plugins, cache).

This module only parses the command line and dispatches; it holds no verb's logic."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from llmrl.launch import cache, env, openai, plugins_list, run, tinker, validate
from llmrl.launch import eval as eval_verb

VERBS = {
    "run": (run, "launch a run: rank 0 runs SCRIPT, the other ranks serve the config's LLMs"),
    "eval": (eval_verb, "evaluate a task (reasoning_gym:NAME, MODULE:ATTR): mean reward and pass@k with intervals"),
    "tinker": (tinker, "serve Tinker's REST API from a run (the tinker SDK and tinker-cookbook recipes train here)"),
    "openai": (openai, "serve an OpenAI-compatible API from a run (/v1/chat/completions, /v1/completions)"),
    "validate": (validate, "check a config without starting anything"),
    "env": (env, "print the versions and accelerator for a bug report"),
    "plugins": (plugins_list, "list the installed plugins"),
    "cache": (cache, "list the model cache (size, state); `llmrl cache clear [NAME]` removes llmrl's own entries"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in VERBS and hasattr(VERBS[argv[0]][0], "parse_argv"):
        # Verbs that read their own command line: `run`, `eval`, `tinker` and `openai` (launcher options and
        # overrides in any order, then the script's own arguments) and `validate` (options between overrides), which
        # one argparse parser with sub-commands cannot express.
        module = VERBS[argv[0]][0]
        return module.main(module.parse_argv(argv[1:]))
    parser = argparse.ArgumentParser(prog="llmrl", description="Hugging Face LLMs as RL agents, on DeepSpeed ranks.")
    parser.add_argument("--version", action="version", version=f"llmrl {installed_version()}")
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (module, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if hasattr(module, "add_arguments"):  # the verbs with parse_argv were dispatched above
            module.add_arguments(verb_parser)
    args = parser.parse_args(argv)
    return VERBS[args.verb][0].main(args)


def installed_version() -> str:
    """The installed distribution's version (``pyproject.toml``'s), or "unknown" when llmrl runs from a folder that
    was not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmrl")
    except PackageNotFoundError:
        return "unknown"


def command() -> NoReturn:
    """The ``llmrl`` command itself: :func:`main`, then leave without tearing down the modules (torch's take half a
    second on our CPUs, on every command; a run's work is all done by then) once ``atexit`` handlers ran and the
    output is flushed."""
    from llmrl.engine.processes import leave

    leave(main(), run_atexit=True)


if __name__ == "__main__":
    command()
