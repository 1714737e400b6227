"""The options of one batch of llmrl's decoding loop (:func:`~.loop.decode`), as one typed, frozen object.

:class:`DecodeOptions` holds the request's part (its generate arguments, special tokens, return sequences, stops,
the cache across calls), set by the caller (:mod:`llmrl.engine.model.generation`), and the decoder's part (the
static caches, the sampler, the packed weights, the frozen trunk, the written-out step), set by
:class:`~.runtime.Decoder` from ``llms.<name>.generation``. This module holds the record only; it imports no torch
and runs nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmrl.engine.model.decoding.packed_linears import PackedWeights
    from llmrl.engine.model.decoding.static_step import StaticDecoder
    from llmrl.engine.model.reuse.trunk import Trunk
    from llmrl.engine.model.stops import StopRecorder


@dataclass(frozen=True)
class DecodeOptions:
    """How one batch is decoded (see the module's docstring); the decoder's fields default to a plain loop: a
    dynamic cache, ``torch.multinomial`` draws, no packs, no trunk, Hugging Face's step.

    Example::

        decode(model, ids, mask, DecodeOptions(cache_name="cache", generate_kwargs={"max_new_tokens": 8},
                                               pad_id=tok.pad_token_id, eos={tok.eos_token_id}))
    """

    # ---- the request's part (the caller's) ----
    cache_name: str  # the argument under which the model takes a key/value cache (reuse.hf_kv.cache_kwarg)
    generate_kwargs: dict  # the request's generate arguments (those decoding.eligibility takes)
    pad_id: int  # fed to (and returned for) rows that ended
    eos: Collection[int]  # the token ids that end a row
    num_return: int = 1  # sequences per prompt (rows i*n .. i*n+n-1 are prompt i's)
    recorder: StopRecorder | None = None  # stop strings and token ids, checked on the host at every step
    # a Hugging Face cache holding the first columns of every prompt row (the cache across calls,
    # reuse.generation_prefix.cached_past): only the columns after them are prefilled
    past: Any = None
    keep_cache: bool = False  # return the final cache in Decoded.cache (for the cache across calls)
    # rows read different LoRA adapters (model.row_adapters): no merged adapter, no static cache (its padding rows)
    mixed_adapters: bool = False
    # ---- the decoder's part (runtime.Decoder's, from llms.<name>.generation) ----
    static: StaticDecoder | None = None  # static caches and the captured step (None: no static cache)
    sampler: str = "multinomial"  # how samples are drawn (decoding.sampling)
    packer: PackedWeights | None = None  # packs the decode steps multiply with
    owners: dict | None = None  # the memory the packer is told of (PackedWeights.for_rows)
    # the frozen trunk that keeps the states this batch computes below its depth for the update that will score
    # these samples (with a dynamic cache or the written-out step and no ``past``)
    trunk: Trunk | None = None
    llama_step: bool = False  # the decode steps run as llama_step.LlamaStep where it takes the model
