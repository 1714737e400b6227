"""The decode step over a preallocated key/value cache, captured once per shape bucket on CUDA.

A decode step's shapes are the rows and the cache length. :func:`bucket` rounds the rows up to a power of two (at
least 8, then multiples of 64 past 64) and the length up to a multiple of ``length_bucket``, so that a run captures
a few shapes, not one per call; the extra rows are copies of the first and are dropped. :class:`StaticDecoder` keeps
one Hugging Face ``StaticCache`` per bucket (its tensors keep their addresses from call to call, which a captured
step needs) and, when compiling, one ``torch.compile(mode="reduce-overhead")`` step, which on CUDA replays the whole
step as a CUDA graph. The first call of a bucket compiles (tens of seconds for a billion-parameter model); later
calls replay. Only the last ``keep`` buckets' caches are kept.

This module does not choose tokens or read log-probs (:mod:`.loop` does).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def bucket(rows: int, length: int, length_bucket: int) -> tuple[int, int]:
    """The (rows, cache length) a decode of ``rows`` rows up to ``length`` positions runs at."""
    if rows <= 64:
        padded = max(8, 1 << (rows - 1).bit_length())
    else:
        padded = -(-rows // 64) * 64
    return padded, -(-length // length_bucket) * length_bucket


class StaticDecoder:
    """Static caches and compiled decode steps, per bucket (see the module's docstring)."""

    def __init__(self, compile_step: bool, length_bucket: int = 256, keep: int = 2):
        self.compile_step = compile_step
        self.length_bucket = length_bucket
        self.keep = keep
        self._caches: OrderedDict = OrderedDict()
        self._compiled = None
        self.compiled_shapes: set[tuple[int, int]] = set()

    def cache(self, model, rows: int, length: int):
        """A reset StaticCache for ``rows`` x ``length`` (from this bucket's pool)."""
        from transformers import StaticCache

        key = (rows, length)
        if key in self._caches:
            self._caches.move_to_end(key)
            cache = self._caches[key]
            cache.reset()
            return cache
        while len(self._caches) >= self.keep:
            self._caches.popitem(last=False)
        cache = StaticCache(config=model.config, max_cache_len=length)
        self._caches[key] = cache
        return cache

    def release(self) -> None:
        """Free every cache (they are allocated again by the next call)."""
        self._caches.clear()

    def held_bytes(self) -> int:
        """The memory the kept caches hold between calls (they keep their addresses for the captured steps)."""
        return sum(t.numel() * t.element_size() for cache in self._caches.values() for layer in cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def step(self, model, cache_name: str, cache, input_ids, position_ids, attention_mask) -> torch.Tensor:
        """The next-token logits (rows x vocabulary, float32, a fresh tensor) of one decode step."""
        if not self.compile_step:
            return _step(model, cache_name, cache, input_ids, position_ids, attention_mask).to(
                copy=True, dtype=torch.float32)
        if self._compiled is None:
            from torch import _dynamo

            _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(_step, mode="reduce-overhead", dynamic=False, fullgraph=False)
        self.compiled_shapes.add((input_ids.shape[0], attention_mask.shape[1]))
        # a CUDA graph's output is overwritten by its next replay: copied out at once
        return self._compiled(model, cache_name, cache, input_ids, position_ids, attention_mask).to(
            copy=True, dtype=torch.float32)


def _step(model, cache_name: str, cache, input_ids, position_ids, attention_mask) -> torch.Tensor:
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                **{cache_name: cache})
    return out.logits[:, -1]
