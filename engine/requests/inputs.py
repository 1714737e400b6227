"""Checks of the arguments a script passes to the Caller, made on the client before anything is sent.

A context, and a candidate, is either a string or a sequence of token ids (a list or tuple of ints, or a 1-D
integer tensor or array, such as the ``tokens`` of a ``generate`` sample); ids are returned as plain lists of
ints, to be used exactly as given. Each check names the argument and what was expected, and raises
:class:`~llmrl.engine.errors.InvalidArgument` (a ValueError) or :class:`~llmrl.engine.errors.InvalidArgumentType`
(a TypeError), both RequestErrors. Ids beyond the model's vocabulary are refused with :func:`check_vocabulary`,
given its size (the servers check again). This module knows nothing about ranks or models.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType

TEXT_OR_IDS = "a string or a list of token ids"


def _is_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def token_ids(value, where: str) -> list[int] | None:
    """``value`` as a list of token ids, or None when it is not a sequence (a string, a number...). Raises when it
    is a sequence holding something else than non-negative ints."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # a torch tensor or numpy array, without importing them
        if getattr(value, "ndim", None) != 1:
            raise InvalidArgumentType(f"{where} must be {TEXT_OR_IDS}; got a tensor of shape {tuple(value.shape)} "
                                      "(token ids are one 1-D integer tensor per sequence)")
        value = value.tolist()
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    ids = list(value)
    for k, token in enumerate(ids):
        if not _is_id(token):
            raise InvalidArgumentType(f"{where}[{k}] must be a token id (an int), got {type(token).__name__} "
                                      f"{token!r}; {where} must be {TEXT_OR_IDS}")
        if token < 0:
            raise InvalidArgument(f"{where}[{k}] is {token}; token ids are non-negative")
    return [int(token) for token in ids]


def check_contexts(contexts) -> list[str | list[int]]:
    if isinstance(contexts, str) or not isinstance(contexts, Sequence):
        raise InvalidArgumentType(f"contexts must be a list of strings or of token id lists, got "
                                  f"{type(contexts).__name__}")
    out: list[str | list[int]] = []
    for i, c in enumerate(contexts):
        if isinstance(c, str):
            out.append(c)
            continue
        ids = token_ids(c, f"contexts[{i}]")
        if ids is None:
            hint = " (one context of token ids is a list of ids: contexts=[[ids...]])" if _is_id(c) else ""
            raise InvalidArgumentType(f"contexts[{i}] must be {TEXT_OR_IDS}, got {type(c).__name__}{hint}")
        if not ids:
            raise InvalidArgument(f"contexts[{i}] is an empty list of token ids; a context needs at least one token "
                                  "(give the BOS id yourself if the model expects one)")
        out.append(ids)
    return out


def check_candidates(candidates, contexts: list) -> list[list[str | list[int]]]:
    """Check one list of candidates per (already checked) context. A string candidate of a context given as token
    ids is refused: it would be tokenised against a text the context does not have."""
    n = len(contexts)
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise InvalidArgumentType(f"candidates must be a list (one list of candidates per context), got "
                                  f"{type(candidates).__name__}")
    if len(candidates) != n:
        raise InvalidArgument(f"got {n} contexts but {len(candidates)} candidate lists; give one list per context")
    out = []
    for i, cands in enumerate(candidates):
        if isinstance(cands, str) or not isinstance(cands, Sequence):
            raise InvalidArgumentType(f"candidates[{i}] must be a list of candidates ({TEXT_OR_IDS} each), got "
                                      f"{type(cands).__name__}")
        row: list[str | list[int]] = []
        for j, c in enumerate(cands):
            if isinstance(c, str):
                if not isinstance(contexts[i], str):
                    raise InvalidArgument(f"candidates[{i}][{j}] is a string but contexts[{i}] is a list of token "
                                          "ids; give the candidate as token ids too (a string would be tokenised "
                                          "against a text the context does not have)")
                row.append(c)
                continue
            ids = token_ids(c, f"candidates[{i}][{j}]")
            if ids is None:
                hint = (" (one candidate of token ids is a list of ids: candidates[i] = [[ids...], ...])"
                        if _is_id(c) else "")
                raise InvalidArgumentType(f"candidates[{i}][{j}] must be {TEXT_OR_IDS}, got {type(c).__name__}{hint}")
            row.append(ids)
        out.append(row)
    return out


def check_vocabulary(contexts: list, candidates: list | None, vocab_size: int | None, llm: str) -> None:
    """Refuse token ids at or beyond ``vocab_size`` (checked inputs), naming the first one's place in the call."""
    if vocab_size is None:
        return
    items = [(f"contexts[{i}]", c) for i, c in enumerate(contexts)]
    items += [(f"candidates[{i}][{j}]", c) for i, cands in enumerate(candidates or []) for j, c in enumerate(cands)]
    for where, ids in items:
        if isinstance(ids, str) or not ids or max(ids) < vocab_size:
            continue
        k = next(k for k, token in enumerate(ids) if token >= vocab_size)
        raise InvalidArgument(f"{where}[{k}] is {ids[k]}, not a token id of LLM {llm!r} (0 <= id < {vocab_size})")


def check_keys(keys) -> tuple[str, ...]:
    if isinstance(keys, str):
        keys = [keys]
    keys = tuple(keys or ())
    for k in keys:
        if not isinstance(k, str):
            raise InvalidArgumentType(f"head keys must be strings, got {type(k).__name__}")
    return keys


def check_head_kwargs(value) -> dict | None:
    """``head_kwargs`` checked: None or a dict with string keys."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentType(f"head_kwargs must be a dict of keyword arguments for the heads, got "
                                  f"{type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise InvalidArgumentType(f"head_kwargs keys must be strings (argument names), got {bad[0]!r}")
    return dict(value) or None


def check_minibatch_size(value) -> int | None:
    """A call's ``minibatch_size``: a positive int, or None for the LLM's own."""
    if value is None:
        return None
    if not _is_id(value) or value < 1:
        raise InvalidArgument(f"minibatch_size must be a positive int (rows per forward pass) or None (the LLM's "
                              f"minibatch_size), got {value!r}")
    return int(value)


def check_seed(value) -> int | None:
    """A call's ``seed``: an int (not a bool, not a float to round), or None."""
    if value is None:
        return None
    if not _is_id(value):
        raise InvalidArgumentType(f"seed must be an int or None, got {type(value).__name__} {value!r}")
    if not -2**62 <= int(value) < 2**62:  # each sample's stream is seeded at seed + its position (a 64-bit int)
        raise InvalidArgument(f"seed must lie in [-2**62, 2**62), got {value}")
    return int(value)
