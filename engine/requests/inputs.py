"""Checks of the arguments a script passes to the Caller, made on the client before anything is sent.

Each check names the argument and what was expected, and raises :class:`~llmrl.engine.errors.InvalidArgument`
(a ValueError) or :class:`~llmrl.engine.errors.InvalidArgumentType` (a TypeError), both RequestErrors. This
module knows nothing about ranks or models.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType


def check_contexts(contexts) -> list[str]:
    if isinstance(contexts, str) or not isinstance(contexts, Sequence):
        raise InvalidArgumentType(f"contexts must be a list of strings, got {type(contexts).__name__}")
    contexts = list(contexts)
    for i, c in enumerate(contexts):
        if not isinstance(c, str):
            raise InvalidArgumentType(f"contexts[{i}] must be a string, got {type(c).__name__}")
    return contexts


def check_candidates(candidates, n: int) -> list[list[str]]:
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise InvalidArgumentType(f"candidates must be a list (one list of strings per context), got {type(candidates).__name__}")
    if len(candidates) != n:
        raise InvalidArgument(f"got {n} contexts but {len(candidates)} candidate lists; give one list per context")
    out = []
    for i, cands in enumerate(candidates):
        if isinstance(cands, str) or not isinstance(cands, Sequence):
            raise InvalidArgumentType(f"candidates[{i}] must be a list of strings, got {type(cands).__name__}")
        for j, c in enumerate(cands):
            if not isinstance(c, str):
                raise InvalidArgumentType(f"candidates[{i}][{j}] must be a string, got {type(c).__name__}")
        out.append(list(cands))
    return out


def check_keys(keys) -> tuple[str, ...]:
    if isinstance(keys, str):
        keys = [keys]
    keys = tuple(keys or ())
    for k in keys:
        if not isinstance(k, str):
            raise InvalidArgumentType(f"head keys must be strings, got {type(k).__name__}")
    return keys
