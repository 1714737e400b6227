"""Whether a saved adapter state (``adapter_state.pt``) can be loaded: every field it holds, checked before anything
changes, and refused naming the field and what to do.

A state is a file that may be damaged or crafted, and ``load_adapter`` copies it into a live optimizer: a moment of
another shape or dtype, a step count below 1 (Adam divides by ``1 - beta ** step``), a negative second moment
(its square root) or a non-finite value is accepted by a copy and makes every later step of that adapter fail, or
poisons it. :func:`check_values` checks what needs no model (types, dtypes, finiteness, step counts, how the adapter
is made), before an adapter is created; :func:`check_against` checks shapes and dtypes against the adapter's
weights and the kind of optimizer that will step them, before a value is copied.

This module reads the state only; :mod:`llmrl.engine.model.training.adapter_state` loads it.
"""

from __future__ import annotations

import math
import numbers

import torch

ADAM = ("step", "exp_avg", "exp_avg_sq")
SQUARES = ("exp_avg_sq", "max_exp_avg_sq")  # Adam's second moments: a square root is taken
HINT = "the file is damaged or was not written by save_adapter: save the adapter again"
MOMENTS_HINT = f"{HINT}, or load it with optimizer=False (fresh moments)"


def _refuse(path, field: str, problem: str, hint: str = HINT) -> None:
    raise ValueError(f"{path}: {field} {problem}; {hint}")


def _finite_tensor(path, field: str, value, hint: str = HINT) -> None:
    if not torch.is_tensor(value) or not value.is_floating_point():
        _refuse(path, field, f"must be a floating-point tensor, got {_kind(value)}", hint)
    if not bool(torch.isfinite(value).all()):
        bad = "nan" if bool(torch.isnan(value).any()) else "inf"
        _refuse(path, field, f"holds a value that is not finite ({bad})", hint)


def _kind(value) -> str:
    return f"a {value.dtype} tensor" if torch.is_tensor(value) else type(value).__name__


def check_values(state: dict, path, optimizer: bool) -> None:
    """The checks that need no model: the weights (and, with ``optimizer``, the moments and step counts) are finite
    tensors of floating point, and the adapter's creation arguments are in range."""
    weights = state.get("weights")
    if not isinstance(weights, dict) or not weights:
        _refuse(path, "'weights'", f"must be a dict of the adapter's weights, got {_kind(weights)}")
    for key, value in weights.items():
        _finite_tensor(path, f"weights[{key!r}]", value)
    _check_how(state.get("how"), path)
    scalings, base = state.get("scalings"), state.get("base")
    if scalings is not None and not (isinstance(scalings, dict) and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in scalings.values())):
        _refuse(path, "'scalings'", "must be a dict of numbers (each LoRA layer's alpha / r)")
    if base is not None and not (isinstance(base, dict) and all(
            torch.is_tensor(v) and v.is_floating_point() and v.dim() == 1 for v in base.values())):
        _refuse(path, "'base'", "must be a dict of 1-D float tensors (a sample of the base weights)")
    moments = state.get("optimizer")
    if not optimizer or moments is None:
        return
    if not isinstance(moments, dict):
        _refuse(path, "'optimizer'", f"must be a dict of per-weight states, got {_kind(moments)}", MOMENTS_HINT)
    for key, entry in moments.items():
        field = f"optimizer[{key!r}]"
        if key not in weights:
            _refuse(path, field, "belongs to no saved weight", MOMENTS_HINT)
        if not isinstance(entry, dict):
            _refuse(path, field, f"must be a dict (a weight's optimizer state), got {_kind(entry)}", MOMENTS_HINT)
        for name, value in entry.items():
            where = f"{field}[{name!r}]"
            if name == "step":
                _check_step(path, where, value)
                continue
            _finite_tensor(path, where, value, MOMENTS_HINT)
            if name in SQUARES and bool((value < 0).any()):
                _refuse(path, where, "holds a negative value (a second moment is a mean of squares)", MOMENTS_HINT)


def _check_step(path, where: str, value) -> None:
    """A step count: a number or a one-value tensor, a whole number >= 1 (a saved moment was made by a step)."""
    if torch.is_tensor(value) and value.numel() == 1 and value.dtype != torch.bool:
        number = float(value.reshape(()))
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        return _refuse(path, where, f"must be a step count (a number), got {_kind(value)}", MOMENTS_HINT)
    if not math.isfinite(number) or number != int(number) or number < 1:
        _refuse(path, where, f"must be a whole number >= 1 (the steps the moments were made by), got {number:g}",
                MOMENTS_HINT)
    return None


def _check_how(how, path) -> None:
    """How the adapter is made again (rank, alpha, seed, targets, dropout)."""
    if not isinstance(how, dict):
        return _refuse(path, "'how'", f"must be a dict of the adapter's creation arguments, got {_kind(how)}")
    rank, alpha, seed = how.get("rank"), how.get("alpha"), how.get("seed", 0)
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 1:
        _refuse(path, "how['rank']", f"must be a positive int, got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
                              or not math.isfinite(alpha) or alpha <= 0):
        _refuse(path, "how['alpha']", f"must be a positive number (or None: 2 x rank), got {alpha!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        _refuse(path, "how['seed']", f"must be an int, got {seed!r}")
    dropout = how.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        _refuse(path, "how['dropout']", f"must be a number in [0, 1), got {dropout!r}")
    targets = how.get("targets")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)):
        _refuse(path, "how['targets']", f"must be a string, a list of strings or None, got {targets!r}")
    return None


def expected_state(group: dict) -> set[str]:
    """The state keys the optimizer of ``group`` keeps per weight once it has stepped it."""
    if "betas" in group:  # Adam, AdamW
        return set(ADAM) | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
    return {"momentum_buffer"} if group.get("momentum", 0) else set()


def check_against(state: dict, params: dict, optimizer, path) -> None:
    """Each saved moment fits the weight it belongs to here (shape, dtype) and the optimizer that will step it
    (``optimizer``: the torch optimizer; None: no moment is loaded)."""
    if optimizer is None:
        return
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for key, entry in (state.get("optimizer") or {}).items():
        if not entry:
            continue  # a weight never stepped: fresh moments
        p, field = params[key], f"optimizer[{key!r}]"
        want = expected_state(groups[id(p)])
        if set(entry) != want:
            _refuse(path, field, f"holds {sorted(entry)}, and this LLM's optimizer ({type(optimizer).__name__}) "
                    f"keeps {sorted(want)}: it was saved by another kind of optimizer", MOMENTS_HINT)
        for name, value in entry.items():
            if name == "step":
                continue
            if value.shape != p.shape:
                _refuse(path, f"{field}[{name!r}]", f"has shape {list(value.shape)}, and the weight it belongs to "
                        f"{list(p.shape)}", MOMENTS_HINT)
            if value.dtype != p.dtype:
                _refuse(path, f"{field}[{name!r}]", f"is {value.dtype}, and the weight it belongs to {p.dtype} "
                        "(the optimizer steps moments in the weight's dtype)", MOMENTS_HINT)


def loaded(value, name: str, device) -> torch.Tensor:
    """A checked saved value as the optimizer keeps it: moments on the weight's device, the step count where torch
    keeps it (on the CPU, unless fused or capturable) as a float tensor."""
    if name != "step":
        return value.to(device).clone()
    if torch.is_tensor(value) and value.is_floating_point() and value.dim() == 0:
        return value.clone()
    return torch.tensor(float(value.reshape(()) if torch.is_tensor(value) else value), dtype=torch.float32)
