"""Rank 0's script of ``llmrl eval --config CONFIG TASK [options]`` (or ``llmrl run --config CONFIG -m
llmrl.engine.client.eval_script TASK [options]``): create the run's Caller, evaluate the task
(:meth:`~llmrl.engine.client.evaluation.Evaluation.evaluate`), print the report as JSON and write it to
``--output``.

TASK is ``reasoning_gym:NAME`` (a reasoning-gym dataset, :class:`~llmrl.engine.envs.ReasoningGymTask`, sized and
seeded by ``--size`` and ``--task-seed``, its settings from ``--dataset-args JSON``), or ``MODULE:ATTR`` /
``path/to/file.py:ATTR``: a task object, or a function or class that returns one when called without arguments.
This module reads its command line and builds the task; the statistics are
:mod:`llmrl.engine.client.evaluation`'s.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

REASONING_GYM = ("reasoning_gym:", "reasoning-gym:", "rg:")


def add_eval_arguments(parser) -> None:
    """The evaluation's own options (``llmrl eval`` takes them out of its command line and hands them here)."""
    parser.add_argument("--samples", type=int, default=0, help="completions sampled per prompt for pass@k (0: none)")
    parser.add_argument("--k", default=None, help="the pass@k to report, comma-separated (default 1,2,4,.. samples)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling and bootstrap seed")
    parser.add_argument("--no-greedy", dest="greedy", action="store_false", help="skip the greedy pass")
    parser.add_argument("--ci", choices=("normal", "bootstrap"), default="normal", help="the intervals' method")
    parser.add_argument("--confidence", type=float, default=0.95, help="the intervals' level")
    parser.add_argument("--temperature", type=float, default=None, help="the sampled pass's temperature")
    parser.add_argument("--top-p", dest="top_p", type=float, default=None, help="the sampled pass's top_p")
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--llm", default=None, help="the LLM to evaluate (default: the config's first)")
    parser.add_argument("--output", default=None, help="write the full report (with per-prompt rewards) here")
    parser.add_argument("--size", type=int, default=100, help="reasoning-gym: how many entries")
    parser.add_argument("--task-seed", dest="task_seed", type=int, default=10_000,
                        help="reasoning-gym: the dataset's seed (keep it away from the seeds you train on)")
    parser.add_argument("--dataset-args", dest="dataset_args", default="{}",
                        help='reasoning-gym: the dataset\'s settings as JSON (\'{"max_digits": 1}\')')
    parser.add_argument("--answer-format", dest="answer_format", default="tag",
                        choices=("tag", "last_line", "last_number", "full"),
                        help="reasoning-gym: how the answer is read from a completion")
    parser.add_argument("--system-prompt", dest="system_prompt", default=None,
                        help="reasoning-gym: the instruction before each question (default: ask for <answer> tags)")
    parser.add_argument("--text", action="store_true", help="reasoning-gym: plain-text prompts, not chat messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmrl eval", description=__doc__.splitlines()[0])
    parser.add_argument("task", help="reasoning_gym:NAME, MODULE:ATTR or path/to/file.py:ATTR")
    add_eval_arguments(parser)
    return parser


def load_task(spec: str, args: argparse.Namespace):
    """The task ``spec`` names (see the module's docstring); ValueError when it names none."""
    from llmrl.engine.envs.eval_task import check_task

    for prefix in REASONING_GYM:
        if spec.startswith(prefix):
            from llmrl.engine.envs.reasoning_gym_tasks import ReasoningGymTask

            return ReasoningGymTask(spec[len(prefix):], size=args.size, seed=args.task_seed,
                                    dataset_args=json.loads(args.dataset_args),
                                    system_prompt=args.system_prompt or True, answer_format=args.answer_format,
                                    chat=not args.text)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"task {spec!r}: give reasoning_gym:NAME, MODULE:ATTR or path/to/file.py:ATTR")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"task {spec!r}: cannot import {where}")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(Path(where).resolve().parent))
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, attr):
        raise ValueError(f"task {spec!r}: {where} has no attribute {attr!r}")
    task = getattr(module, attr)
    if not callable(getattr(task, "prompts", None)) and callable(task):
        task = task()  # a factory
    return check_task(task)


def evaluate_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of :meth:`Caller.evaluate` the command line gives."""
    options = {"samples": args.samples, "greedy": args.greedy, "seed": args.seed, "ci": args.ci,
               "confidence": args.confidence, "max_new_tokens": args.max_new_tokens}
    if args.k:
        options["k"] = [int(size) for size in args.k.split(",")]
    for name in ("temperature", "top_p", "llm"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        task = load_task(args.task, args)
    except (ValueError, TypeError, ImportError) as err:
        print(f"llmrl eval: {err}", file=sys.stderr)
        return 2
    from llmrl import Caller

    with Caller() as caller:
        report = caller.evaluate(task, **evaluate_options(args))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "per_prompt"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
