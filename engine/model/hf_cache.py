"""How a Hugging Face model call takes and returns its key/value cache, whatever the transformers version.

transformers 5.24 renamed the cache argument of every model's ``forward`` (and of its decoder layers) from
``past_key_values`` to ``cache``, and the output field with it; the old argument name still works there with a
deprecation warning until 5.40, the old output field is gone. Our code passes the cache under the name the
installed version declares and reads it from either field, so one code path runs on 5.x before and after the
rename. This module does not build caches (``scoring._cache_of`` and ``packing._past_cache`` do).
"""
from __future__ import annotations

import functools
import inspect


@functools.cache
def cache_kwarg() -> str:
    """The name under which this transformers version's models take a key/value cache."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments that hand ``cache`` (a ``transformers.Cache`` or None) to a model call."""
    return {cache_kwarg(): cache}


def cache_of(output):
    """The key/value cache a model call returned (None when it kept none)."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    return cache


def layer_cache(kwargs: dict):
    """The key/value cache a decoder layer was handed in ``kwargs`` (None when it was handed none)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
