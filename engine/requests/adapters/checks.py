"""The checks the adapter request kinds share, made on the client before anything is sent: the name of an adapter
or snapshot (one that exists: an identifier; one to make: llmrl's rule, :mod:`llmrl.engine.adapter_names`), and
the shape of a new adapter (rank, alpha, seed, targets). Each refusal names the field.

This module checks arguments only; it sends nothing (the kinds do: :mod:`llmrl.engine.requests.adapters`).
"""

from __future__ import annotations

import math
import numbers

from llmrl.engine.adapter_names import name_problem
from llmrl.engine.errors import InvalidArgument, InvalidArgumentType


def check_name(name, what: str) -> str:
    """The name of an adapter or snapshot that exists (the servers say if it does not): an identifier."""
    if not isinstance(name, str):
        raise InvalidArgumentType(f"{what} must be a string, got {type(name).__name__}")
    if not name.isidentifier():
        raise InvalidArgument(f"{what} must be an identifier (letters, digits and _, not starting with a digit), "
                              f"got {name!r}")
    return name


def check_new_name(name, what: str) -> str:
    """The name of an adapter or snapshot to make: llmrl's rule (:mod:`llmrl.engine.adapter_names`)."""
    check_name(name, what)
    problem = name_problem(name)
    if problem is not None:
        raise InvalidArgument(f"{what} {name!r} is refused by llmrl's rule for adapter names: it {problem}")
    return name


def check_create_args(rank, alpha, seed, targets) -> dict:
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 1:
        raise InvalidArgument(f"rank must be a positive int, got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
                              or not math.isfinite(alpha) or alpha <= 0):
        raise InvalidArgument(f"alpha must be a positive number (default: 2 x rank), got {alpha!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise InvalidArgument(f"seed must be an int, got {seed!r}")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)):
        raise InvalidArgument(f"targets must be a string or a list of strings ('attention', 'mlp', 'unembed' or "
                              f"module names), got {targets!r}")
    return {"rank": int(rank), "alpha": None if alpha is None else float(alpha), "seed": int(seed),
            "targets": targets if targets is None or isinstance(targets, str) else list(targets)}

