"""Hugging Face key/value caches: how a model call takes and returns one, whatever the transformers version, and
how the scoring passes build one from held pieces.

transformers 5.24 renamed the cache argument of every model's ``forward`` (and of its decoder layers) from
``past_key_values`` to ``cache``, and the output field with it; the old argument name still works there with a
deprecation warning until 5.40, the old output field is gone. A model's own ``forward`` says which name it takes
(a model shipped as remote code may still take the old one on a new transformers, and would drop the new one
into ``**kwargs`` unseen), so the name is read from each model class; the scoring code hands its cache to
:func:`~llmrl.engine.model.reuse.trunk.make_caller` as ``cache`` and the caller renames it.

The builders (:func:`select_rows`, :func:`cache_from_pieces`, :func:`lay_pieces`) lay keys and values held
elsewhere (the prefix cache across calls, a common prefix just encoded) into a cache a model call continues from.
This module makes no model call and decides nothing about which tokens are held.
"""
from __future__ import annotations

import copy
import functools
import inspect


def cache_kwarg(model) -> str:
    """The name under which ``model`` (a Hugging Face model, or a PEFT wrapper around one) takes a key/value
    cache: ``cache`` where its ``forward`` declares it, else ``past_key_values``."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return _declared_name(type(model))


@functools.cache
def _declared_name(cls) -> str:
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def cache_of(output):
    """The key/value cache a model call returned (None when it kept none)."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    return cache


def layer_cache(kwargs: dict):
    """The key/value cache a decoder layer (or a model) was handed in ``kwargs`` (None when it was handed none)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def select_rows(cache, rows):
    """A copy of ``cache`` holding the given batch rows (a long tensor); the original is left untouched."""
    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    selected.batch_select_indices(rows)
    return selected


def lay_pieces(keys, values, row: int, at: int, end: int, pieces: list, layer: int) -> None:
    """Copy ``pieces`` (each: per layer, keys and values ``[kv_heads, tokens, head_dim]``) end to end into
    ``keys[row, :, at:end]`` / ``values[...]`` for one layer, stopping at ``end``."""
    for piece in pieces:
        take = min(piece[layer][0].shape[1], end - at)
        if take <= 0:
            break
        keys[row, :, at:at + take] = piece[layer][0][:, :take]
        values[row, :, at:at + take] = piece[layer][1][:, :take]
        at += take


def empty_layers(sample: list, rows: int, width: int) -> list[tuple]:
    """Per layer, zero keys and values ``[rows, kv_heads, width, head_dim]`` shaped like ``sample``'s pieces."""
    return [(k0.new_zeros((rows, k0.shape[0], width, k0.shape[2])),
             v0.new_zeros((rows, v0.shape[0], width, v0.shape[2])))
            for k0, v0 in sample]


def as_cache(layers: list[tuple]):
    """A Hugging Face ``DynamicCache`` holding per layer (keys, values) ``[rows, kv_heads, tokens, head_dim]``."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def cache_from_pieces(rows: list[list], lengths: list[int]):
    """A cache whose row ``a`` holds the first ``lengths[a]`` tokens of ``rows[a]`` (pieces laid end to end), left
    padded to the longest row."""
    width = max(lengths)
    layers = empty_layers(next(r[0] for r in rows if r), len(rows), width)
    for layer, (keys, values) in enumerate(layers):
        for a, (pieces, length) in enumerate(zip(rows, lengths)):
            lay_pieces(keys, values, a, width - length, width, pieces, layer)
    return as_cache(layers)
