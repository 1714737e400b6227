"""The decode step over a preallocated key/value cache, captured once per shape bucket on CUDA.

A decode step's shapes are the rows and the cache length. :func:`bucket` rounds the rows up to a power of two (at
least 8, then multiples of 64 past 64) and the length up to a multiple of ``length_bucket``, so that a run captures
a few shapes, not one per call; the extra rows are copies of the first and are dropped. :class:`StaticDecoder` keeps
one Hugging Face ``StaticCache`` per bucket (its tensors keep their addresses from call to call, which a captured
step needs) and, when compiling, one ``torch.compile(mode="reduce-overhead")`` step, which on CUDA replays the whole
step as a CUDA graph. The first call of a bucket compiles (tens of seconds for a billion-parameter model); later
calls replay. Only the last ``keep`` buckets' caches are kept.

A step attends over a *window* of the cache, not its whole length: the filled columns rounded up to a multiple of
``window_columns`` (``generation.attention_window``, 64 by default), or of an eighth of the length where that is more
(:func:`window`: at most :data:`MAX_WINDOWS` widths per cache length). A static cache's step otherwise
reads every column at every step, filled or not: at 512 new tokens after a 64-token prompt, 768 columns from the
first step on, where the steps need 65 to 576 (on SmolLM2-1.7B's shape at 64 rows, 9.7 GB of keys and values a step
against 3.4 GB of weights). The window is read from the cache's own tensors (a view of their first columns: the same
addresses, which a captured step needs) and the attention mask is cut to it; the columns left out are masked anyway,
so the results are those of the whole length, to rounding. When compiling, the window's width is marked dynamic, so
one compiled step serves every window of a bucket (on CUDA each new width is captured as a graph of its own, without
compiling again). For that every window must be laid out alike: the cache holds one spare column, never attended, so
that a window is always a strided view of its tensors, never the whole of them (a view that is the whole tensor is
contiguous, and the compiler would specialise a second step on it). ``window_columns`` 0 attends over the whole
length. Only caches whose every layer is Hugging Face's plain ``StaticLayer`` are windowed.

This module does not choose tokens or read log-probs (:mod:`.loop` does).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

MAX_WINDOWS = 8  # widths per cache length at most (on CUDA each width is a captured graph of its own)


def window(filled: int, length: int, window_columns: int) -> int:
    """The columns a step attends over when ``filled`` columns of a ``length``-column cache hold keys (its own token's
    included): ``filled`` rounded up to a multiple of ``window_columns``, or of ``length / MAX_WINDOWS`` (rounded up)
    where that is more."""
    step = max(window_columns, -(-length // MAX_WINDOWS))
    return min(length, -(-filled // step) * step)


def bucket(rows: int, length: int, length_bucket: int) -> tuple[int, int]:
    """The (rows, cache length) a decode of ``rows`` rows up to ``length`` positions runs at."""
    if rows <= 64:
        padded = max(8, 1 << (rows - 1).bit_length())
    else:
        padded = -(-rows // 64) * 64
    return padded, -(-length // length_bucket) * length_bucket


class StaticDecoder:
    """Static caches and compiled decode steps, per bucket (see the module's docstring)."""

    def __init__(self, compile_step: bool, length_bucket: int = 256, keep: int = 2, window_columns: int = 64):
        self.compile_step = compile_step
        self.length_bucket = length_bucket
        self.window_columns = window_columns  # 0: every step attends over the whole cache
        self.keep = keep
        self._caches: OrderedDict = OrderedDict()
        self._compiled = None
        self.compiled_shapes: set[tuple[int, int, int]] = set()  # (rows, cache length, window)

    def cache(self, model, rows: int, length: int):
        """A reset StaticCache for ``rows`` x ``length`` (from this bucket's pool)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        key = (rows, length)
        if key in self._caches:
            self._caches.move_to_end(key)
            cache = self._caches[key]
            cache.reset()
            window = _windowed(cache)
            if window is not None:
                window.mask = None  # (the last call's window: the whole length until the next step sets one)
            return cache
        while len(self._caches) >= self.keep:
            self._caches.popitem(last=False)
        cache = StaticCache(config=model.config, max_cache_len=length)
        if self.window_columns and all(type(layer) is StaticLayer for layer in cache.layers):
            shared, windowed_layer = _Window(length), _windowed_layer_class()
            # one spare column, never attended: every window is then a strided view, never the whole tensor
            cache.layers = [windowed_layer(length + 1, shared) for _ in cache.layers]
        self._caches[key] = cache
        return cache

    def held_bytes(self) -> int:
        """The memory the kept caches hold between calls (they keep their addresses for the captured steps)."""
        return sum(t.numel() * t.element_size() for cache in self._caches.values() for layer in cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def step(self, model, cache_name: str, cache, input_ids, position_ids, attention_mask,
             filled: int) -> torch.Tensor:
        """The next-token logits (rows x vocabulary, float32, a fresh tensor) of one decode step; ``filled``: the
        cache's columns that hold keys once this step's token is in."""
        length = attention_mask.shape[1]
        windowed = _windowed(cache)
        if windowed is not None:
            # (a copy: every window's mask is laid out alike, see the module's docstring)
            attention_mask = attention_mask[:, :window(filled, length, self.window_columns)].contiguous()
            if self.compile_step:
                torch._dynamo.maybe_mark_dynamic(attention_mask, 1)
            windowed.mask = attention_mask  # the layers read the window's width from it
        if not self.compile_step:
            return _step(model, cache_name, cache, input_ids, position_ids, attention_mask).to(
                copy=True, dtype=torch.float32)
        if self._compiled is None:
            from torch import _dynamo

            _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(_step, mode="reduce-overhead", dynamic=False, fullgraph=False)
        self.compiled_shapes.add((input_ids.shape[0], length, attention_mask.shape[1]))
        # a CUDA graph's output is overwritten by its next replay: copied out at once
        return self._compiled(model, cache_name, cache, input_ids, position_ids, attention_mask).to(
            copy=True, dtype=torch.float32)


def _step(model, cache_name: str, cache, input_ids, position_ids, attention_mask) -> torch.Tensor:
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                **{cache_name: cache})
    return out.logits[:, -1]


class _Window:
    """The columns the steps of one cache attend over (shared by its layers; set before each step)."""

    def __init__(self, columns: int):
        self.length = columns
        self.mask = None

    @property
    def columns(self):
        return self.mask.shape[1] if self.mask is not None else self.length


def _windowed(cache) -> _Window | None:
    """The window of a cache made by :meth:`StaticDecoder.cache` with windowed layers, or None."""
    layers = getattr(cache, "layers", None)
    found = getattr(layers[0], "window", None) if layers else None
    return found if isinstance(found, _Window) else None


@functools.cache
def _windowed_layer_class():
    from transformers.cache_utils import StaticLayer

    class WindowedLayer(StaticLayer):
        """Hugging Face's static layer, whose update hands back the window's columns of its keys and values (views:
        the same memory) and whose mask spans the window."""

        def __init__(self, max_cache_len: int, window: _Window):
            super().__init__(max_cache_len=max_cache_len)
            self.window = window

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            columns = self.window.columns
            return keys[:, :, :columns], values[:, :, :columns]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.window.columns, 0

    return WindowedLayer
