"""Sampling weights: the active LoRA adapter folded into a copy of each weight it touches, for decoding.

Unmerged, every adapted linear layer runs three matmuls (base, A, B) and their adds: on a GPU, where a decode
step is hundreds of small kernels, that is most of the adapter's cost. :class:`MergedLora` keeps, per adapted layer,
``W + scaling * B @ A`` (Hugging Face PEFT's own ``get_delta_weight``, added in the weight's dtype as PEFT's merge
adds it) in a buffer of its own. :meth:`MergedLora.swapped_in` points each base layer's weight at its buffer and
turns the adapter branch off for the duration of a decoding call, then puts back the very tensors that were there:
the trained weights are never written, so scoring and updates see exactly what they saw before.

The buffers are rebuilt when the adapter changes: another adapter name, a LoRA weight whose values differ from the
copy kept when they were built (compared exactly, each call; the LoRA weights are about 1% of the model), or a
base weight that is another tensor. In float32 the merged weights give log-probs within 1e-5 of the unmerged model;
in bfloat16 each merged weight is rounded once to bfloat16, so log-probs differ from ``score``'s by bfloat16's
rounding (measured figures: README, Generation).

Not merged (the adapter then runs unmerged): DoRA and the other LoRA variants, adapters with a bias (``lora_bias``),
layers PEFT merged itself (``merge_adapter()``: the delta is in the base weight already), base weights tied to
another layer's (an output layer tied to the embeddings: its merged copy would stand in for the embeddings too),
quantized base weights, trainable base weights (the ``freeze`` plugin's ``unfreeze`` under LoRA),
ZeRO-3's outside a call that gathered them, LoRA on embeddings or convolutions, and several adapters active at once.
This module does not decode.
"""

from __future__ import annotations

import contextlib

import torch


def lora_layers(model) -> list:
    """Every PEFT LoRA layer in ``model`` (empty without PEFT)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def shared_weights(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters that more than one module of ``model`` holds (tied weights: an output layer tied to
    the embeddings)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def why_not_mergeable(layers: list, adapter: str, gathered: bool = False, shared: set[int] = frozenset()) -> str | None:
    """None when every layer holding ``adapter`` can be merged; else the reason. ``gathered``: ZeRO-3's weights are
    whole for this call. ``shared``: the ids of weights other modules hold too (:func:`shared_weights`)."""
    from peft.tuners.lora import Linear

    for layer in layers:
        if adapter not in layer.lora_A:
            continue
        if not isinstance(layer, Linear) or not isinstance(layer.get_base_layer(), torch.nn.Linear):
            return f"a LoRA layer of type {type(layer).__name__} over {type(layer.get_base_layer()).__name__}"
        if adapter in getattr(layer, "lora_variant", {}):
            return "a LoRA variant (DoRA or another) that merges differently"
        if getattr(layer, "merged_adapters", None):  # PEFT's own merge (merge_adapter()): in W already
            return "an adapter merged into the base weight by PEFT (merge_adapter)"
        if getattr(layer, "lora_bias", {}).get(adapter, False):  # PEFT adds B's bias to the output: not in B @ A
            return "a LoRA adapter with a bias (lora_bias), which the merged weight would leave out"
        weight = layer.get_base_layer().weight
        if id(weight) in shared:  # the merged copy would stand in for the other module's weight too
            return "a base weight shared with another layer (tied embeddings)"
        if not weight.is_floating_point() or (hasattr(weight, "ds_id") and not gathered):
            return "base weights that are quantized or partitioned by ZeRO-3"
        if weight.requires_grad:  # the copy is rebuilt when the adapter changes; a trained base weight is not watched
            return "a trainable base weight under the adapter"
    return None


class MergedLora:
    """The merged weights of one adapter, rebuilt when it changes (see the module's docstring)."""

    def __init__(self):
        self.adapter: str | None = None
        self._layers: list = []
        self._merged: list[torch.Tensor] = []
        self._seen: list[tuple] = []  # per layer: copies of A and B, the scaling, the base weight's identity
        self.builds = 0  # how many times the buffers were (re)built, for tests and statistics

    def _state(self, layer, adapter: str) -> tuple:
        base = layer.get_base_layer().weight
        return (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, float(layer.scaling[adapter]),
                base.data_ptr(), base.dtype, tuple(base.shape))

    def _current(self, layers: list, adapter: str) -> bool:
        if adapter != self.adapter or [id(x) for x in layers] != [id(x) for x in self._layers]:
            return False
        for layer, seen in zip(layers, self._seen):
            a, b, *rest = self._state(layer, adapter)
            if tuple(rest) != seen[2:] or not torch.equal(a, seen[0]) or not torch.equal(b, seen[1]):
                return False
        return True

    @torch.no_grad()
    def _build(self, layers: list, adapter: str) -> None:
        reuse = len(self._merged) == len(layers)
        merged, seen = [], []
        for i, layer in enumerate(layers):
            weight = layer.get_base_layer().weight
            delta = layer.get_delta_weight(adapter).to(weight.dtype)
            buffer = self._merged[i] if reuse and self._merged[i].shape == weight.shape \
                and self._merged[i].dtype == weight.dtype and self._merged[i].device == weight.device \
                else torch.empty_like(weight)
            torch.add(weight, delta, out=buffer)  # in place: a captured decode step keeps reading the same buffers
            merged.append(buffer)
            a, b, *rest = self._state(layer, adapter)
            seen.append((a.detach().clone(), b.detach().clone(), *rest))
        self.adapter, self._layers, self._merged, self._seen = adapter, list(layers), merged, seen
        self.builds += 1

    def held_bytes(self) -> int:
        """The memory the merged weights hold between calls."""
        return sum(t.numel() * t.element_size() for t in self._merged)

    def owners(self) -> dict[int, torch.Tensor]:
        """The merged buffers by address: their version counters count their rebuilds (for packed copies)."""
        return {buffer.data_ptr(): buffer for buffer in self._merged}

    def release(self) -> None:
        """Free the buffers (they are rebuilt at the next decoding call that merges)."""
        self.adapter, self._layers, self._merged, self._seen = None, [], [], []

    @contextlib.contextmanager
    def swapped_in(self, layers: list, adapter: str):
        """Decode with ``adapter`` merged: each adapted layer's base weight is its merged buffer and its LoRA
        branch is off; on exit (an error included) the original tensors and flags are back."""
        layers = [layer for layer in layers if adapter in layer.lora_A]
        if not self._current(layers, adapter):
            self._build(layers, adapter)
        originals = [layer.get_base_layer().weight.data for layer in layers]
        flags = [layer._disable_adapters for layer in layers]
        try:
            for layer, buffer in zip(layers, self._merged):
                layer.get_base_layer().weight.data = buffer
                layer._disable_adapters = True  # the flag only: requires_grad flags are left as they are
            yield self
        finally:
            for layer, weight, flag in zip(layers, originals, flags):
                layer.get_base_layer().weight.data = weight
                layer._disable_adapters = flag
