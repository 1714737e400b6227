"""How the decoding loop holds a batch's key/value cache and computes one decode step: one strategy per way.

Every strategy has the interface of :class:`CacheStrategy`: ``why_not(model, batch)`` names why it declines a batch
(None: it takes it), ``rows(batch)`` the rows its steps run at, ``prefill(model, batch, prompts)`` takes over the
prompts' prefilled Hugging Face cache (one row per prompt) as the cache it uses, repeated for each row, ``step(tokens)``
feeds one token per row and returns the next float32 logits (rows x vocabulary), ``hf_cache()`` hands the cache it
uses back as Hugging Face's, and ``recorded`` lists the states each step handed to the frozen trunk. The three:

- :class:`StaticCacheStrategy`: :class:`~.static_step.StaticDecoder`'s preallocated ``StaticCache`` of bucketed
  shape (rows padded with copies of the first prompt's), whose step may be captured; it declines a model with a
  sliding window shorter than the bucketed length (Hugging Face's static sliding layers keep only the window);
- :class:`WrittenOutStrategy`: :class:`~.llama_step.LlamaStep`'s cache preallocated for the batch and filled in place
  by the written-out step; it declines what :meth:`~.llama_step.LlamaStep.why_not` names, and a single new token;
- :class:`DynamicCacheStrategy`: Hugging Face's ``DynamicCache``, grown by the model's own forward at each step (with
  the frozen trunk recording); it declines nothing.

:func:`choose` takes the first configured one that takes the batch, in that order. This module does not run the
prefill, choose tokens or read log-probs (:mod:`.loop` does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmrl.engine.model.decoding.eligibility import slides_within
from llmrl.engine.model.decoding.llama_step import LlamaStep
from llmrl.engine.model.decoding.options import DecodeOptions
from llmrl.engine.model.decoding.static_step import StaticDecoder, bucket


@dataclass(frozen=True)
class PaddedBatch:
    """One batch of left-padded prompts as the strategies see it."""

    ids: torch.Tensor  # prompts x width, left-padded, on the model's device
    mask: torch.Tensor  # prompts x width: the prompts' attention mask
    positions: torch.Tensor  # prompts x width: each column's position (0 on the padding)
    source: torch.Tensor  # rows: each row's prompt (prompt-major)
    num_return: int  # rows per prompt
    max_new: int  # new tokens at most
    pad_id: int  # fed to the rows a static cache pads the batch with
    recording: Any = None  # the frozen trunk recording this batch's states (reuse.trunk.Trunk), or None

    @property
    def rows(self) -> int:
        return len(self.source)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def length(self) -> int:
        """The positions the batch holds at most: its prompts' width and every new token."""
        return self.width + self.max_new


class CacheStrategy(Protocol):
    """How one batch's key/value cache is held and one decode step computed (see the module's docstring)."""

    recorded: list  # with the batch's ``recording``: the states entering the trunk's depth at each step

    def why_not(self, model, batch: PaddedBatch) -> str | None:
        """None when this strategy decodes ``batch`` of ``model``; else why not, in a phrase."""

    def rows(self, batch: PaddedBatch) -> int:
        """The rows the steps run at (the batch's, or more: the extra ones are dropped)."""

    def prefill(self, model, batch: PaddedBatch, prompts) -> None:
        """Take over ``prompts``, the Hugging Face cache of the batch's prompts (one row per prompt, every column
        filled), as the cache the steps use (each row its prompt's)."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (one per row of the batch) at the next position: the next float32 logits (rows x
        vocabulary)."""

    def hf_cache(self):
        """The cache the steps filled, as a Hugging Face cache (for the cache kept across calls)."""


def _last_positions(batch: PaddedBatch, rows: torch.Tensor) -> torch.Tensor:
    return batch.positions[rows, -1:].clone()


class DynamicCacheStrategy:
    """Hugging Face's ``DynamicCache`` grown by the model's forward (see the module's docstring)."""

    def __init__(self, cache_name: str):
        self.cache_name = cache_name
        self.recorded: list = []

    def why_not(self, model, batch: PaddedBatch) -> str | None:
        return None

    def rows(self, batch: PaddedBatch) -> int:
        return batch.rows

    def prefill(self, model, batch: PaddedBatch, prompts) -> None:
        self.model, self.batch, self.cache = model, batch, prompts
        if batch.num_return > 1:
            self.cache.batch_repeat_interleave(batch.num_return)
        self.attention = batch.mask[batch.source]
        self.positions = _last_positions(batch, batch.source)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.positions += 1
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(tokens), 1))], dim=1)
        recording = self.batch.recording
        with recording.active("record") if recording is not None else contextlib.nullcontext():
            out = self.model(input_ids=tokens[:, None], position_ids=self.positions, attention_mask=self.attention,
                             use_cache=True, **{self.cache_name: self.cache})
            if recording is not None:
                self.recorded.append(recording.take_captured())
        return out.logits[:, -1].float()  # a view of this step's own logits (no copy in float32)

    def hf_cache(self):
        return self.cache


class StaticCacheStrategy:
    """A static cache of bucketed shape and its (captured) step (see the module's docstring)."""

    def __init__(self, static: StaticDecoder, cache_name: str):
        self.static, self.cache_name = static, cache_name
        self.recorded: list = []  # (a static cache never records: the trunk keeps states of dynamic caches only)

    def _shape(self, batch: PaddedBatch) -> tuple[int, int]:
        return bucket(batch.rows, batch.length, self.static.length_bucket)

    def why_not(self, model, batch: PaddedBatch) -> str | None:
        if slides_within(model.config, self._shape(batch)[1]):
            return "a sliding attention window shorter than the bucketed cache (static sliding layers keep the window)"
        return None

    def rows(self, batch: PaddedBatch) -> int:
        return self._shape(batch)[0]

    def prefill(self, model, batch: PaddedBatch, prompts) -> None:
        self.model, self.batch = model, batch
        padded, length = self._shape(batch)
        into = torch.cat([batch.source, batch.source.new_zeros(padded - batch.rows)])  # extra rows: the first prompt
        self.cache = self.static.cache(model, padded, length)
        for index, layer in enumerate(prompts.layers):
            self.cache.update(layer.keys[into], layer.values[into], index)
        self.attention = torch.ones((padded, length), dtype=batch.mask.dtype, device=batch.mask.device)
        self.attention[:, :batch.width] = batch.mask[into]
        self.positions = _last_positions(batch, into)
        self.filled = batch.width

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.positions += 1
        self.filled += 1
        rows, padded = len(tokens), len(self.positions)
        feed = tokens if padded == rows else torch.cat([tokens, tokens.new_full((padded - rows,), self.batch.pad_id)])
        return self.static.step(self.model, self.cache_name, self.cache, feed[:, None], self.positions,
                                self.attention, self.filled)[:rows]

    def hf_cache(self):
        return self.cache


class WrittenOutStrategy:
    """The decode step written out as plain tensor code (:class:`~.llama_step.LlamaStep`)."""

    def __init__(self, trunk=None):
        self.trunk = trunk  # the frozen trunk whose hook on its depth's layer is expected
        self.recorded: list = []

    def why_not(self, model, batch: PaddedBatch) -> str | None:
        if batch.max_new <= 1:
            return "a single new token (no decode step to run)"
        return LlamaStep.why_not(model, batch.length, self.trunk)

    def rows(self, batch: PaddedBatch) -> int:
        return batch.rows

    def prefill(self, model, batch: PaddedBatch, prompts) -> None:
        # (built where the caller holds the packs of the steps' rows: its linear layers call the packs)
        recording = batch.recording
        self.config, self.batch = model.config, batch
        self.stepper = LlamaStep(model, prompts, batch.source, batch.length,
                                 recording.depth if recording is not None else None)
        self.attention = torch.zeros((batch.rows, batch.length), dtype=torch.bool, device=batch.mask.device)
        self.attention[:, :batch.width] = batch.mask[batch.source].bool()
        self.positions = _last_positions(batch, batch.source)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.positions += 1
        self.attention[:, self.stepper.filled] = True
        logits, state = self.stepper.step(tokens, self.positions, self.attention)
        if self.batch.recording is not None:
            self.recorded.append(state)
        return logits

    def hf_cache(self):
        return self.stepper.hf_cache(self.config)


def choose(model, batch: PaddedBatch, options: DecodeOptions) -> CacheStrategy:
    """The first configured strategy that takes ``batch``: the static cache (``options.static``), the written-out
    step (``options.llama_step``), else the dynamic cache."""
    configured: list = []
    if options.static is not None:
        configured.append(StaticCacheStrategy(options.static, options.cache_name))
    if options.llama_step:
        configured.append(WrittenOutStrategy(options.trunk))
    configured.append(DynamicCacheStrategy(options.cache_name))
    return next(strategy for strategy in configured if strategy.why_not(model, batch) is None)
