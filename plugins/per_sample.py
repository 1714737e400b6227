"""Per-sample keyword arguments of ``update``: which ones are cut with the samples, and their shapes checked on the
client before anything is sent.

An updater declares the keyword arguments it reads per sample in its ``per_sample_args`` class attribute, each with a
level:

- ``"sample"``: one value per context (``actions``, ``advantages``, ``margins``), not a sequence;
- ``"candidate"``: per context, one value per candidate (``rewards`` of each continuation; a bare number when the
  context has one candidate);
- ``"token"``: per context, one sequence per candidate with one value per scored token of it (``old_logprobs``);
- ``"candidate_or_token"``: per context, one entry per candidate, each a value (of the whole candidate) or a
  sequence with one value per scored token (``ppo_tokens``' ``rewards``: a score, or dense per-token rewards).

A declared argument must have one entry per context: a wrong length is refused naming the argument, its length
and the number of contexts; nested levels are checked against the call's candidates (per-token lengths where the
candidates are token ids, which are scored exactly as given). Declared arguments are sliced per replica; every
other argument reaches every replica whole.

An updater that declares nothing (``per_sample_args = None``) keeps the length rule: a sized argument (a list, tuple,
tensor or array; not a string or dict) whose length equals the number of contexts is sliced, the others go whole.
Its errors say which arguments the rule sliced (:func:`slicing_note`).

:func:`positional` turns an array-like that is not a list, tuple, tensor or numpy array (a pandas Series, an
``array.array``, a deque) into one indexed by position, before any check or slice: a Series of a shuffled frame is
indexed by its labels, and slicing it by label would pair each sample with another's value.

:func:`take_samples` is the one slicing rule, used wherever per-sample values are cut: the client splitting an
``update`` per replica, the server splitting minibatches, scoring splitting head arguments per piece.

This module checks shapes and slices; it never reads values: values (NaN, infinities) are checked by
:mod:`llmrl.engine.requests.finite`.
"""

from __future__ import annotations

import array
import numbers
from collections.abc import Sequence

from llmrl.engine.errors import InvalidArgument

LEVELS = ("sample", "candidate", "token", "candidate_or_token")


def is_per_sample(value, n: int) -> bool:
    """The length rule: any sized value of length ``n`` except strings, bytes and mappings."""
    if isinstance(value, (str, bytes, dict)):
        return False
    try:
        return len(value) == n
    except TypeError:
        return False


def positional(value):
    """``value`` indexed by position: a list, tuple, tensor, numpy array, string, bytes, dict, number or None as it
    is; any other array-like (a pandas Series or DataFrame column, ``array.array``, ``memoryview``: anything numpy
    converts through ``__array__`` or the buffer protocol) as a numpy array; any other sequence (a deque, a range)
    as a list. Other objects are returned as they are."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (list, tuple, str, bytes, dict, numbers.Number, torch.Tensor, np.ndarray)):
        return value
    if hasattr(value, "__array__") or isinstance(value, (memoryview, array.array)):
        return np.array(value.to_numpy() if hasattr(value, "to_numpy") else value)  # a copy: writable, the caller's own
    if isinstance(value, Sequence):  # a deque, a range
        return list(value)
    return value


def take_samples(value, positions: Sequence[int]):
    """The entries of a per-sample ``value`` at ``positions``, in that order and of the same kind: a tensor (a copy
    made by indexing), a numpy array, a tuple; any other sequence gives a list."""
    positions = list(positions)
    value = positional(value)
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value[torch.tensor(positions, dtype=torch.long)] if positions else value[:0]
    except ImportError:
        pass
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            return value[positions]
    except ImportError:
        pass
    return type(value)(value[p] for p in positions) if isinstance(value, tuple) else [value[p] for p in positions]


def declaration_problem(cls, name: str) -> str | None:
    """Why an updater class's ``per_sample_args`` (or ``whole_args``) declaration is invalid, or None."""
    whole = getattr(cls, "whole_args", None)
    if whole is not None and (not isinstance(whole, (tuple, list)) or not all(isinstance(k, str) for k in whole)):
        return (f"updater {name!r} ({cls.__qualname__}): whole_args = {whole!r}; it must be a tuple of keyword "
                "argument names (or None to accept any)")
    declared = getattr(cls, "per_sample_args", None)
    if declared is None:
        return None
    if not isinstance(declared, dict) or not all(isinstance(k, str) and v in LEVELS for k, v in declared.items()):
        return (f"updater {name!r} ({cls.__qualname__}): per_sample_args = {declared!r}; it must be a dict from "
                f"keyword argument names to levels, each one of {', '.join(LEVELS)} (or None to keep the length rule)")
    return None


def per_sample_keys(kwargs: dict, n: int, declared: dict | None) -> list[str]:
    """The keyword arguments sliced with the samples: the declared ones, or those the length rule picks."""
    if declared is None:
        return [k for k, v in kwargs.items() if is_per_sample(v, n)]
    return [k for k in kwargs if k in declared]


def check_per_sample(kwargs: dict, contexts: list, candidates: list | None, declared: dict | None,
                     updater: str) -> None:
    """Refuse a declared per-sample argument whose shape does not fit the call (:class:`InvalidArgument`)."""
    n = len(contexts)
    for key, level in (declared or {}).items():
        if key not in kwargs or kwargs[key] is None:
            continue
        value = kwargs[key]
        length = _length(value)
        if length != n:
            got = f"has {length} entries" if length is not None else f"is a {type(value).__name__}"
            raise InvalidArgument(f"update argument {key!r} {got}, but the call has {n} contexts: the updater "
                                  f"{updater!r} reads it per sample ({level} level), one entry per context; nothing "
                                  "was sent")
        if level == "sample":
            _check_values(key, value, updater)
            continue
        if candidates is None:
            continue
        for i, (entry, cands) in enumerate(zip(value, candidates)):
            _check_entry(key, level, i, entry, cands)


def _check_values(key: str, value, updater: str) -> None:
    """A sample-level argument holds one value per context, not a sequence (an ``(n, 1)`` array would broadcast
    against the updater's per-sample tensors into an ``n x n`` loss, pairing every sample with every other's value)."""
    if getattr(value, "ndim", None) == 1:  # a flat array or tensor: no need to look at each entry
        return
    for i, entry in enumerate(value):
        length = _length(entry)
        if length is not None:
            raise InvalidArgument(f"update argument {key!r}[{i}] holds {length} values, but the updater {updater!r} "
                                  f"reads one value per context (sample level): pass a flat sequence of {len(value)} "
                                  "numbers (an array of shape (n, 1) holds one sequence per context); nothing was sent")


def _check_entry(key: str, level: str, i: int, entry, cands: list) -> None:
    k = len(cands)
    if level in ("candidate", "candidate_or_token") and isinstance(entry, numbers.Number) and k == 1:
        return
    length = _length(entry)
    if length != k:
        got = f"{length} values" if length is not None else f"a {type(entry).__name__}"
        what = {"candidate": "value", "token": "sequence of per-token values",
                "candidate_or_token": "value (or sequence of per-token values)"}[level]
        raise InvalidArgument(f"update argument {key!r}[{i}] holds {got}, but context {i} has {k} candidate(s): "
                              f"pass one {what} per candidate; nothing was sent")
    if level == "candidate":
        return
    for j, (sequence, candidate) in enumerate(zip(entry, cands)):
        if level == "candidate_or_token" and _length(sequence) is None:
            continue  # a value of the whole candidate
        if isinstance(candidate, (list, tuple)) and all(isinstance(t, int) for t in candidate):
            if _length(sequence) != len(candidate):
                hint = ("one value per token" if level == "token" else
                        "one value per token (dense), or one value for the whole candidate")
                raise InvalidArgument(f"update argument {key!r}[{i}][{j}] holds {_length(sequence)} values, but "
                                      f"candidate {j} of context {i} has {len(candidate)} token ids: pass {hint}; "
                                      "nothing was sent")


def _length(value) -> int | None:
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        return len(value)
    except TypeError:
        return None


def slicing_note(kwargs: dict, sliced: list[str] | None) -> str:
    """For an error of an updater that declares nothing: which arguments the length rule sliced, and which it
    passed whole."""
    if sliced is None or not kwargs:
        return ""
    whole = [k for k in kwargs if k not in sliced]
    return (f" (this updater declares no per_sample_args, so the length rule decided: sliced per sample "
            f"{sliced or 'none'}, passed whole {whole or 'none'}; declare per_sample_args on the updater to have their "
            "shapes checked before sending)")
