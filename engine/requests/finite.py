"""Refuse NaN and infinite numbers anywhere in ``update``'s keyword arguments, and anything but numbers in its
declared per-sample arguments, before anything is sent.

One NaN among the rewards, advantages or old log-probs turns every weight into NaN at the first optimizer step.
:func:`check_finite` walks each argument however it is nested (lists and tuples, ragged or not, dicts, torch
tensors, numpy arrays and scalars, Python floats, any other number, array-like or sized container), checking every
tensor or array with one vectorised test, and names the first bad value by its path (``rewards[2][5]``). Strings,
booleans, integers and other objects are left alone.

This module checks values only; lengths and per-sample slicing are the update request's.
"""

from __future__ import annotations

import math
import numbers

import torch

from llmrl.engine.errors import InvalidArgument


def check_finite(kwargs: dict) -> None:
    """Raise :class:`InvalidArgument` naming the first NaN or infinite number among ``kwargs``' values."""
    for key, value in kwargs.items():
        found = first_non_finite(value, key)
        if found is not None:
            path, bad, count = found
            raise InvalidArgument(f"update argument {key!r} holds {bad} at {path} ({count} non-finite value(s) "
                                  "there); nothing was sent, no weight changed")


def check_numbers(kwargs: dict, declared: dict | None, updater: str) -> None:
    """Raise :class:`InvalidArgument` naming the first string (or other non-number) inside an argument the updater
    declares per sample (``declared``): it reads numbers there, and a string would fail on a server with a message
    that names neither the argument nor the sample."""
    for key in declared or {}:
        found = first_non_number(kwargs.get(key), key)
        if found is not None:
            path, bad = found
            raise InvalidArgument(f"update argument {key!r} holds {bad!r} at {path}, not a number: the updater "
                                  f"{updater!r} reads it per sample as numbers (lists, tensors or arrays of them); "
                                  "nothing was sent")


def first_non_number(value, path: str) -> tuple[str, object] | None:
    """``(path, value)`` of the first entry of ``value`` (nested lists, tuples, tensors, arrays, any array-like)
    that is not a number, or None (None itself counts as absent)."""
    if value is None or isinstance(value, (numbers.Number, torch.Tensor)):
        return None
    if isinstance(value, (str, bytes, dict)):
        return path, value
    arrays = isinstance(value, (list, tuple)) and any(  # torch converts a list of arrays slowly, and warns
        isinstance(v, torch.Tensor) or type(v).__module__ == "numpy" for v in value)
    try:  # the common case, numbers in a rectangular list or an array-like (numpy, pandas): one conversion
        if not arrays:
            torch.as_tensor(value)
            return None
    except (TypeError, ValueError, RuntimeError):
        pass
    if getattr(value, "ndim", None) == 0:  # a 0-d array of objects or text: its one value
        return first_non_number(value.item(), path)
    if hasattr(value, "__iter__"):  # ragged lists, lists of tensors, object or string arrays: one by one
        for i, inner in enumerate(value):
            found = first_non_number(inner, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    try:
        float(value)
        return None
    except (TypeError, ValueError):
        return path, value


def first_non_finite(value, path: str) -> tuple[str, float, int] | None:
    """``(path, value, count)`` of the first non-finite number inside ``value`` (count: in the innermost array
    or list that holds it), or None."""
    if value is None or isinstance(value, (str, bytes, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value, 1)
    if isinstance(value, torch.Tensor):
        return _in_array(value.detach(), path)
    if type(value).__module__ == "numpy":
        return _in_numpy(value, path)
    if isinstance(value, dict):
        for key, inner in value.items():
            found = first_non_finite(inner, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        arrays = any(isinstance(v, torch.Tensor) or type(v).__module__ == "numpy" for v in value)
        try:  # the common case, a flat or rectangular list of numbers: one vectorised check
            if not arrays:
                return _in_array(torch.as_tensor(value), path)
        except (TypeError, ValueError, RuntimeError):
            pass
        for i, inner in enumerate(value):
            found = first_non_finite(inner, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(value, numbers.Number):  # Decimal, Fraction, complex, a third party's number type
        try:
            number = complex(value)
        except (TypeError, ValueError):
            return None
        return None if math.isfinite(number.real) and math.isfinite(number.imag) else (path, value, 1)
    if hasattr(value, "__array__") or isinstance(value, memoryview):  # pandas, array.array, any array-like
        return _in_numpy(value, path)
    if hasattr(value, "__iter__") and hasattr(value, "__len__"):  # a deque, a range, any other sized container
        return first_non_finite(list(value), path)
    return None


def _in_numpy(value, path: str):
    import numpy as np

    array = np.asarray(value)
    if array.dtype == object:
        return first_non_finite(array.tolist(), path)
    if array.dtype.kind not in "fc":
        return None
    return _in_array(torch.from_numpy(np.require(array, requirements=["C", "W"])), path)


def _in_array(tensor: torch.Tensor, path: str):
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    bad = ~torch.isfinite(tensor)
    if not bool(bad.any()):
        return None
    if tensor.dim() == 0:
        return path, tensor.item(), 1
    where = tuple(int(i) for i in bad.nonzero()[0])
    return path + "".join(f"[{i}]" for i in where), tensor[where].item(), int(bad.sum())
