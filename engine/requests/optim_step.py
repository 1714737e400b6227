"""The ``optim_step`` request kind, behind ``Caller.optim_step``: one optimizer step over the gradients that
``forward_backward`` calls accumulated, with the hyperparameters the script gives for this step.

Client half: the hyperparameters are checked (:func:`check_step_settings`) and sent to every rank of the LLM.
Server half: :func:`llmrl.engine.model.training.client_steps.optim_step`. Every replica answers the same; the
first replica's answer is returned.

This module steps nothing itself.
"""

from __future__ import annotations

import math
import numbers
from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests.base import Kind, Run

NAME = "optim_step"

# Tinker's AdamParams fields: what each may be.
SETTINGS = {
    "learning_rate": (">= 0 (0: the moments move, the weights stay)", lambda v: v >= 0),
    "beta1": ("in [0, 1)", lambda v: 0 <= v < 1),
    "beta2": ("in [0, 1)", lambda v: 0 <= v < 1),
    "eps": ("> 0", lambda v: v > 0),
    "weight_decay": (">= 0", lambda v: v >= 0),
    "grad_clip_norm": (">= 0 (0: no clipping)", lambda v: v >= 0),
}
ADAM_ONLY = ("beta1", "beta2", "eps")


@dataclass(frozen=True)
class OptimStepRequest:
    settings: dict = field(default_factory=dict)  # the SETTINGS given for this step (others: the config's)
    adapter: str | None = None  # None: every adapter with gradients


def check_step_settings(adam_params, optimizer) -> dict:
    """The step's hyperparameters from a dict or an object with those attributes (``tinker.AdamParams``); None
    values are left out (the config's ``training.optimizer`` applies). ``optimizer``: the LLM's
    ``training.optimizer`` (its type alone checks each field on its own). Raises naming the field at fault."""
    optimizer_type = optimizer if isinstance(optimizer, str) else optimizer.type
    if adam_params is None:
        return {}
    if isinstance(adam_params, dict):
        given = dict(adam_params)
        unknown = sorted(set(given) - set(SETTINGS))
        if unknown:
            raise InvalidArgument(f"adam_params has unknown key(s) {unknown}; it takes {', '.join(SETTINGS)}")
    else:
        given = {key: getattr(adam_params, key) for key in SETTINGS if hasattr(adam_params, key)}
        if not given:
            raise InvalidArgumentType(f"adam_params must be a dict (or an object such as tinker.AdamParams) with "
                                      f"{', '.join(SETTINGS)}; got {type(adam_params).__name__}")
    out = {}
    for key, value in given.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):  # numpy's too
            raise InvalidArgument(f"adam_params[{key!r}] must be a finite number, got {value!r}")
        rule, ok = SETTINGS[key]
        if not ok(value):
            raise InvalidArgument(f"adam_params[{key!r}] must be {rule}, got {value!r}")
        if key in ADAM_ONLY and optimizer_type == "sgd":
            raise InvalidArgument(f"adam_params[{key!r}] is for Adam, but this LLM's optimizer is SGD "
                                  "(training.optimizer.type): give learning_rate, weight_decay and grad_clip_norm only")
        out[key] = float(value)
    if optimizer_type == "adamw" and not isinstance(optimizer, str):
        _check_decay(out, optimizer)
    return out


def _check_decay(settings: dict, optimizer) -> None:
    """AdamW multiplies each weight by ``1 - lr * weight_decay`` before its step: at ``lr * weight_decay >= 1`` the
    weights are zeroed or flipped (and overflow at large values), whatever the gradients."""
    lr, decay = settings.get("learning_rate", optimizer.lr), settings.get("weight_decay", optimizer.weight_decay)
    if lr * decay < 1:
        return
    names = [f"adam_params[{key!r}]" if key in settings else
             f"the config's {key} (training.optimizer.{config}: {value:g})"
             for key, config, value in (("learning_rate", "lr", lr), ("weight_decay", "weight_decay", decay))]
    raise InvalidArgument(f"{names[0]} x {names[1]} is {lr * decay:g}: AdamW multiplies each weight by 1 - "
                          "learning_rate x weight_decay at every step, which must stay in (0, 1] (at >= 1 the "
                          "weights are zeroed or flipped, and overflow); keep learning_rate x weight_decay below 1 "
                          "(typically about 1e-5, e.g. learning_rate 1e-4 with weight_decay 0.1)")


def send(run: Run, llm: str, request: OptimStepRequest) -> Future:
    replicas = run.replicas(llm)
    parts = [(ranks, request) for ranks in replicas]
    return run.submit(NAME, parts, lambda values: values[replicas[0][0]])


def handle(replica, request: OptimStepRequest):
    result = replica.backend.optim_step(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=OptimStepRequest, send=send, handle=handle, backend_method="optim_step",
            caller_methods=("optim_step_async", "optim_step"))
