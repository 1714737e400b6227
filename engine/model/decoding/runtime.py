"""One LLM's decoding setup: which loop runs each ``generate`` batch, with its merged weights and static caches.

:class:`Decoder` reads ``llms.<name>.generation`` (decoder ``auto`` / ``hf`` / ``llmrl``, ``merge_adapter``,
``compile``, ``static_cache``, ``length_bucket``, ``attention_window``, ``sampler``, ``pack_weights``, ``llama_step``,
``keep_gathered``), keeps the :class:`~.merged_lora.MergedLora` buffers and the :class:`~.static_step.StaticDecoder`
between calls, counts which loop ran (``server_memory`` reports it).
``merge_adapter``, ``compile`` and ``static_cache`` default to ``auto``: on CUDA devices. On a CPU a decode step is
bound by the weight matmuls: merging saves about a tenth, and a cache padded to its bucket only adds attention work;
``pack_weights`` (``auto``: on CPU devices) packs the weights once for the CPU's matmul kernel, MKL's or oneDNN's
(:mod:`.packed_linears`; under ZeRO-3 the packs of weights gathered for a call are dropped at its end);
``llama_step`` (``auto``: on CPU devices) runs the decode steps of Llama-shaped models as plain tensor code
(:mod:`.llama_step`).
Under ZeRO-3 the loop runs only on weights gathered for the call, which lie at new addresses at every call. With
``keep_gathered`` (``auto``: when the step is compiled) the weights the step reads are copied into buffers kept
between calls (:mod:`.kept_weights`) and the adapter is merged in place into its kept buffers, so the static cache
and the captured step run as under ZeRO-2. Without it, the loop decodes without a static cache or a captured step,
and merges the adapter for each batch alone (the merged copy, the size of the adapted weights, is freed after it).
Where the weights' addresses matter (a static cache or a captured step), ``weight_moves`` counts the batches whose
weights lay elsewhere than in the batch before (a CUDA graph is then captured again).

This module decides and delegates; the loop is :mod:`.loop`, the request's shape :mod:`llmrl.engine.model.generation`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace

from llmrl.engine.model.decoding.eligibility import why_not
from llmrl.engine.model.decoding.kept_weights import KeptWeights, is_its_shard, weights_read
from llmrl.engine.model.decoding.merged_lora import MergedLora, lora_layers, shared_weights, why_not_mergeable
from llmrl.engine.model.decoding.options import DecodeOptions


def _on(value, on_cuda: bool) -> bool:
    return on_cuda if value == "auto" else bool(value)


class Decoder:
    """The decoding loop of one served LLM (see the module's docstring)."""

    def __init__(self, settings, device_type: str, zero3: bool = False, trunk=None):
        from llmrl.engine.model.decoding.packed_linears import KERNELS, PackedWeights, default_kernel
        from llmrl.engine.model.decoding.static_step import StaticDecoder

        self.settings, self.zero3 = settings, zero3
        self.trunk = trunk  # a frozen trunk (trunk_reuse_mb) keeps the states each batch computes below its depth
        cuda = device_type == "cuda"
        compiling = _on(settings.compile, cuda)
        # under ZeRO-3 the captured step and static cache need the weights kept at fixed addresses
        keeping = compiling or _on(settings.static_cache, cuda)
        self.kept = KeptWeights() if zero3 and keeping and _on(settings.keep_gathered, compiling) else None
        movable = zero3 and self.kept is None
        self.compiled = compiling and not movable
        self.merged = MergedLora() if _on(settings.merge_adapter, cuda) else None
        static = self.compiled or (_on(settings.static_cache, cuda) and not movable)
        self.static = StaticDecoder(self.compiled, settings.length_bucket,
                                    window_columns=settings.attention_window) if static else None
        packing = _on(settings.pack_weights, device_type == "cpu") and not self.compiled
        kernel = settings.pack_weights if settings.pack_weights in KERNELS else default_kernel()
        # (a compiled step packs what its compiler packs)
        # (under ZeRO-3 the packs sit beside the gathered weights: MKL's of one row count at a time, not two)
        self.packed = PackedWeights(kernel, keep_row_counts=1 if zero3 else 2) \
            if packing and kernel is not None else None
        self.llama_step = _on(settings.llama_step, device_type == "cpu")
        self.llama_step_batches = 0  # batches whose steps ran as llama_step.LlamaStep
        self.counts: Counter = Counter()  # calls run by each loop, and why llmrl's was passed over
        self._addresses: tuple | None = None  # where the last batch's weights lay (with a static cache)
        self.weight_moves = 0  # batches whose weights lay elsewhere than the batch before's

    def choose_and_count(self, kind: str, kwargs: dict, *, stepwise: bool, synced: bool, zero3: bool,
                         recurrent: bool = False, configured: dict | None = None) -> bool:
        """Choose the loop that runs this request's batches and count the choice in :attr:`counts` (with the reason
        llmrl's loop was passed over); True: llmrl's loop, False: Hugging Face's ``generate``. Raises ValueError
        where the config demands llmrl's loop (``decoder: llmrl``) and the request cannot use it."""
        if self.settings.decoder == "hf":
            self.counts["hf: configured"] += 1
            return False
        reason = why_not(kind, kwargs, stepwise=stepwise, synced=synced, zero3=zero3, recurrent=recurrent,
                         configured=configured)
        if reason is not None and self.settings.decoder == "llmrl":
            raise ValueError(f"generation.decoder is 'llmrl' but this request cannot use it: {reason}; set "
                             "llms.<name>.generation.decoder to auto (Hugging Face's generate takes such requests) "
                             "or change the request")
        self.counts["llmrl" if reason is None else "hf: " + reason.split(" (")[0]] += 1
        return reason is None

    def new_call(self) -> None:
        """A ``generate`` call begins (its batches run on one gather of ZeRO-3's weights)."""
        if self.kept is not None:
            self.kept.new_call()

    def end_call(self) -> None:
        """A ``generate`` call ended. Under ZeRO-3, the packs of weights gathered into memory that is freed with the
        call (a group of several ranks; the merged adapter's buffers, rebuilt at each batch) are dropped; in a group
        of one rank each weight is its own shard, whose packs are kept as under ZeRO-2."""
        if self.zero3 and self.packed is not None:
            self.packed.keep_only(lambda layer, memory: is_its_shard(layer.weight, memory))

    def batches(self, model, plan, token_budget: int, max_rows: int) -> list[tuple[list[int], int]]:
        """The loop's batches for a planned request (:mod:`.batches`): prefill within ``token_budget``, rows
        within ``max_rows``, the cache within ``generation.cache_mb``."""
        from llmrl.engine.model.decoding.batches import cache_bytes_per_token, decode_batches

        element = next(model.parameters()).element_size()
        per_token = cache_bytes_per_token(model.config, element)
        cache_tokens = max(1, int(self.settings.cache_mb * 2**20 // per_token))
        new_tokens = int(plan.kwargs["max_new_tokens"])
        return decode_batches([len(p) for p in plan.prompts], new_tokens, plan.num_return, token_budget, max_rows,
                              cache_tokens)

    def decode(self, model, ids, mask, options: DecodeOptions):
        """Run the loop on one batch (see :func:`.loop.decode`), with the active adapter merged where it can be
        (not where rows read different adapters: ``options.mixed_adapters``, which runs without a static cache).
        ``options``: the request's :class:`~.options.DecodeOptions`; this decoder sets their decoder's part."""
        from llmrl.engine.model.decoding.loop import decode

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        merging, merged_layers = contextlib.nullcontext(), []
        adapter = getattr(model, "active_adapter", None) if hasattr(model, "get_base_model") else None
        static = None if options.mixed_adapters else self.static
        if self.merged is not None and isinstance(adapter, str) and not options.mixed_adapters:
            layers = lora_layers(inner)
            if layers and why_not_mergeable(layers, adapter, gathered=self.zero3,
                                            shared=shared_weights(inner)) is None:
                merging = self.merged.swapped_in(layers, adapter)
                merged_layers = [layer for layer in layers if adapter in layer.lora_A]
        # the weights the step reads matter only where their addresses do (5.6 ms a batch for SmolLM2-135M: not
        # walked on the other paths)
        read = weights_read(inner, merged_layers) if static is not None else []
        keeping = self.kept.swapped_in(read) if self.kept is not None else contextlib.nullcontext()
        try:
            with merging as merged, keeping:
                if static is not None:
                    self._note_addresses(read, merged_layers)
                owners = merged.owners() if merged is not None else None  # the merged buffers, for the packs
                decoded = decode(inner, ids, mask, replace(
                    options, static=static, sampler=self.settings.sampler, packer=self.packed, owners=owners,
                    trunk=self.trunk, llama_step=self.llama_step))
                self.llama_step_batches += decoded.llama_step
                return decoded
        finally:
            if self.zero3 and self.kept is None and self.merged is not None:  # built on weights freed after the call
                self.merged.release()

    def _note_addresses(self, read: list, merged_layers: list) -> None:
        addresses = tuple(p.data_ptr() for p in read) + tuple(
            layer.get_base_layer().weight.data_ptr() for layer in merged_layers)
        if self._addresses is not None and addresses != self._addresses:
            self.weight_moves += 1
        self._addresses = addresses

    def stats(self) -> dict:
        """Calls run by each loop (and why llmrl's was passed over), adapter merges, compiled shapes, and the memory
        the merged weights and static caches hold between calls."""
        return {"calls": dict(self.counts), "merges": self.merged.builds if self.merged is not None else 0,
                "compiled_shapes": sorted(self.static.compiled_shapes) if self.static is not None else [],
                "merged_weights_mb": self.merged.held_bytes() / 2**20 if self.merged is not None else 0.0,
                "packed_weights_mb": self.packed.held_bytes() / 2**20 if self.packed is not None else 0.0,
                "weights_packed": self.packed.packs if self.packed is not None else 0,
                "packed_for": self.packed.kernel if self.packed is not None else None,
                "llama_step_batches": self.llama_step_batches,
                "kept_weights_mb": self.kept.held_bytes() / 2**20 if self.kept is not None else 0.0,
                "weight_moves": self.weight_moves,
                "static_cache_mb": self.static.held_bytes() / 2**20 if self.static is not None else 0.0}
