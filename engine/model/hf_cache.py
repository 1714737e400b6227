"""How a Hugging Face model call takes and returns its key/value cache, whatever the transformers version.

transformers 5.24 renamed the cache argument of every model's ``forward`` (and of its decoder layers) from
``past_key_values`` to ``cache``, and the output field with it; the old argument name still works there with a
deprecation warning until 5.40, the old output field is gone. A model's own ``forward`` says which name it takes
(a model shipped as remote code may still take the old one on a new transformers, and would drop the new one
into ``**kwargs`` unseen), so the name is read from each model class; the scoring code hands its cache to
:func:`~llmrl.engine.model.scoring.make_caller` as ``cache`` and the caller renames it. This module does not
build caches (``scoring._cache_of`` and ``packing._past_cache`` do).
"""
from __future__ import annotations

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
