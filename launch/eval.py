"""``llmrl eval``: start a run whose rank 0 evaluates a task (:mod:`llmrl.engine.client.eval_script`) and prints the
report (mean reward and pass@k with confidence intervals) as JSON.

    llmrl eval --config CONFIG TASK [--samples N] [--k 1,4] [--seed S] [--temperature T] [--output F] ...
               [launcher options and key=value overrides]

The evaluation's own options and TASK are taken out of the command line and handed to the script; everything else
is ``llmrl run``'s (a config, overrides, a hostfile). This module only rewrites the command line (:func:`split_argv`,
a pure function); ``llmrl run`` does the rest.
"""

from __future__ import annotations

import argparse

from llmrl.engine.client.eval_script import add_eval_arguments
from llmrl.launch import run
from llmrl.launch.rank import is_override

MODULE = "llmrl.engine.client.eval_script"
USAGE = ("llmrl eval --config CONFIG TASK [--samples N] [--k K,...] [--seed S] [--temperature T] [--output F] "
         "[evaluation options] [launcher options] [key.sub=value ...]")
LAUNCHER_FLAGS = ("--no_ssh", "--no-ssh", "--dry-run", "--dry_run")  # the launcher's options that take no value


def eval_options() -> dict[str, bool]:
    """Each evaluation option's name -> whether it takes a value."""
    parser = argparse.ArgumentParser(add_help=False)
    add_eval_arguments(parser)
    return {name: action.nargs != 0 for action in parser._actions for name in action.option_strings}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(run's arguments, the script's: TASK then the evaluation's options)``; pure. TASK is the one token that is
    neither an option, an option's value nor a ``key=value`` override. ValueError when there is not exactly one."""
    options = eval_options()
    rest, script, tasks, k = [], [], [], 0
    while k < len(argv):
        token = argv[k]
        name = token.split("=", 1)[0]
        if name in options:
            takes_value = options[name] and "=" not in token
            if takes_value and k + 1 >= len(argv):
                raise ValueError(f"{token} needs a value")
            script += argv[k:k + 2] if takes_value else [token]
            k += 2 if takes_value else 1
            continue
        if token.startswith("-"):
            takes_value = "=" not in token and token not in LAUNCHER_FLAGS and k + 1 < len(argv)
            rest += argv[k:k + 2] if takes_value else [token]
            k += 2 if takes_value else 1
            continue
        (rest if is_override(token) else tasks).append(token)
        k += 1
    if len(tasks) != 1:
        raise ValueError(f"give one TASK (reasoning_gym:NAME, MODULE:ATTR or file.py:ATTR); got {tasks or 'none'}")
    return rest, [tasks[0], *script]


def help_parser() -> argparse.ArgumentParser:
    """The parser whose help ``llmrl eval --help`` prints: TASK and the evaluation's options, then the launcher's."""
    parser = argparse.ArgumentParser(
        prog="llmrl eval", usage=USAGE,
        description="Start a run whose rank 0 evaluates TASK on the config's LLM: the mean reward and pass@k, greedy "
                    "and sampled, with confidence intervals, printed as JSON. Options and key.sub=value overrides "
                    "come in any order.")
    parser.add_argument("task", help="reasoning_gym:NAME, MODULE:ATTR or path/to/file.py:ATTR (a task object, or a "
                                     "function returning one)")
    add_eval_arguments(parser.add_argument_group("the evaluation"))
    run.add_arguments(parser.add_argument_group("the launcher (as llmrl run)"), script=False)
    return parser


def parse_argv(argv: list[str]) -> run.RunRequest:
    if any(token in ("-h", "--help") for token in argv):
        help_parser().print_help()
        raise SystemExit(0)
    try:
        rest, script = split_argv(argv)
    except ValueError as err:
        raise SystemExit(f"llmrl eval: {err}") from None
    return run.parse_argv([*rest, "-m", MODULE, *script])


def main(request: run.RunRequest) -> int:
    return run.main(request)
