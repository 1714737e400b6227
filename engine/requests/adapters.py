"""The ``adapters`` request kind, behind ``Caller.snapshot`` / ``drop_snapshot`` / ``create_adapter`` /
``delete_adapter`` / ``save_adapter`` / ``load_adapter``: change which LoRA adapters and frozen snapshots an LLM
holds, on every one of its ranks, and save or load one adapter's state.

Client half: the operation must be one of :data:`OPERATIONS` (any other is refused before anything is sent), and
its arguments are checked (names, those of new adapters and snapshots by llmrl's rule:
:mod:`llmrl.engine.adapter_names`; rank, seed, targets) and sent to every rank of the LLM (every replica must hold
the same adapters). Server half: an operation not in :data:`OPERATIONS` is refused again (the error goes
back to the client; the server keeps serving and nothing changes), and the backend applies a known one through the
table of :mod:`llmrl.engine.model.adapter_operations`, each operation to its own handler
(:mod:`llmrl.engine.model.snapshots`, :mod:`llmrl.engine.model.training.new_adapters`,
:mod:`llmrl.engine.model.training.adapter_state`); the first replica's answer is returned.

This module changes nothing itself.
"""

from __future__ import annotations

import math
import numbers
from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.adapter_names import name_problem
from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests.base import Kind, Run

NAME = "adapters"
OPERATIONS = ("snapshot", "drop_snapshot", "create_adapter", "delete_adapter", "save_adapter", "load_adapter")


@dataclass(frozen=True)
class AdapterRequest:
    operation: str  # one of OPERATIONS
    name: str
    args: dict = field(default_factory=dict)


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


def check_operation(operation) -> str:
    """One of :data:`OPERATIONS`; any other is refused naming the field and the known operations."""
    if not isinstance(operation, str) or operation not in OPERATIONS:
        raise InvalidArgument(f"operation must be one of {', '.join(OPERATIONS)}, got {operation!r}")
    return operation


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


def send(run: Run, llm: str, request: AdapterRequest) -> Future:
    check_operation(request.operation)
    replicas = run.replicas(llm)
    return run.submit(NAME, [(ranks, request) for ranks in replicas], lambda values: values[replicas[0][0]])


def handle(replica, request: AdapterRequest):
    check_operation(request.operation)  # a server never guesses what an unknown operation meant
    result = replica.backend.manage_adapters(request.operation, request.name, request.args)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=AdapterRequest, send=send, handle=handle, backend_method="manage_adapters",
            caller_methods=("snapshot", "drop_snapshot", "create_adapter", "delete_adapter", "save_adapter",
                            "load_adapter"))
