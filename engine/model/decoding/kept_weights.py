"""ZeRO-3's gathered weights copied into buffers kept between decoding calls, so that they lie at the same addresses.

Under ZeRO-3 a ``generate`` call gathers every weight (:mod:`llmrl.engine.model.zero3_gather`) into tensors freed
after the call; the next call's gather puts them at other addresses. A captured decode step (a CUDA graph) reads its
inputs where it was captured, so with weights that move it must be captured again at every call, or not used at all.
:class:`KeptWeights` keeps one buffer per weight the decode step reads, copies the call's gathered values into it
(``copy_``: the same bits, once per call: :meth:`KeptWeights.new_call`) and points the parameter at it for each
batch's duration, then puts back the gathered tensor, an error included, so that DeepSpeed partitions and frees what
it gathered as before. In a ZeRO-3 group of one rank the gathered weights are the rank's own shards, which do not
move: those are not copied. The adapter's merged weights (:class:`~.merged_lora.MergedLora`) are rebuilt in place
into buffers of their own, so the weights they replace are not copied here.

The buffers cost, on each rank, the memory of the weights they hold (the weights the merged adapter does not
replace, beside the rank's ZeRO-3 shard); like the merged weights and static caches, they stay allocated between
calls, through updates too (a model is gathered only when its whole size is within ``training.zero3_gather_mb``,
which so bounds them). ``generation.keep_gathered`` turns them on (``auto``: when the decode step is compiled; only
with a static cache, since nothing else reads the addresses). This module gathers nothing and decodes nothing.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class KeptWeights:
    """One buffer per parameter, kept from call to call (see the module's docstring)."""

    def __init__(self):
        self._buffers: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._copied: dict[int, int] = {}  # parameter -> its source's address when copied in this call (new_call)
        self.allocations = 0  # buffers allocated (a buffer is allocated again only when its weight's shape changes)
        self.copies = 0  # parameters copied into their buffers

    def new_call(self) -> None:
        """A new gathered call begins: each weight is copied in again at its first batch (the weights may have
        changed since the last call; within a call they do not)."""
        self._copied.clear()

    def _buffer(self, param: torch.Tensor) -> torch.Tensor:
        ref, buffer = self._buffers.get(id(param), (None, None))
        if buffer is None or ref() is not param or buffer.shape != param.data.shape \
                or buffer.dtype != param.dtype or buffer.device != param.device:
            buffer = torch.empty_like(param.data)
            self._buffers[id(param)] = (weakref.ref(param), buffer)
            self._copied.pop(id(param), None)
            self.allocations += 1
        return buffer

    @contextlib.contextmanager
    def swapped_in(self, params: list):
        """Inside, each of ``params`` holds its current values in its kept buffer (copied at the call's first
        batch); on exit (an error included) each holds the very tensor it held before. A parameter whose gathered
        values are its own ZeRO-3 shard (a group of one rank: DeepSpeed's gather then copies nothing) lies at a fixed
        address already and is left as it is."""
        swapped = []
        try:
            for param in params:
                if is_its_shard(param):
                    continue
                buffer = self._buffer(param)
                if self._copied.get(id(param)) != param.data_ptr():  # a new call, or gathered anew
                    buffer.copy_(param.data)
                    self._copied[id(param)] = param.data_ptr()
                    self.copies += 1
                swapped.append((param, param.data))
                param.data = buffer
            yield self
        finally:
            for param, tensor in swapped:
                param.data = tensor

    def held_bytes(self) -> int:
        """The memory the kept buffers hold between calls."""
        return sum(buffer.numel() * buffer.element_size() for _, buffer in self._buffers.values())

    def release(self) -> None:
        """Free the buffers (allocated again by the next call that keeps weights)."""
        self._buffers.clear()
        self._copied.clear()


def is_its_shard(param: torch.Tensor, memory: torch.Tensor | None = None) -> bool:
    """Whether ``memory`` (default: the parameter's own values) is the parameter's whole ZeRO-3 shard: in a group of
    one rank, what DeepSpeed's gather hands the parameter, which stays allocated between calls."""
    memory = param if memory is None else memory
    shard = getattr(param, "ds_tensor", None)
    return isinstance(shard, torch.Tensor) and shard.numel() == memory.numel() and shard.device == memory.device \
        and shard.data_ptr() == memory.data_ptr()


def weights_read(model: torch.nn.Module, merged_layers: list) -> list:
    """The parameters a decode step of ``model`` reads: all of them but, in each of ``merged_layers`` (LoRA layers
    decoding with their adapter merged and their branch off), the base weight (its merged buffer stands in for it)
    and the LoRA weights."""
    skipped = set()
    for layer in merged_layers:
        skipped.add(id(layer.get_base_layer().weight))
        for name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            part = getattr(layer, name, None)
            if isinstance(part, torch.nn.Module):
                skipped.update(id(p) for p in part.parameters())
            elif isinstance(part, dict):
                skipped.update(id(p) for p in part.values())
    return [param for param in model.parameters() if id(param) not in skipped]
