"""llmrl's own decoding loop for ``generate``: one prefill per prompt, a preallocated key/value cache, the LoRA
adapter merged into sampling weights, and on CUDA the decode step captured once per shape bucket.

- :mod:`.runtime`: one LLM's :class:`~.runtime.Decoder`: chooses the loop for each request (counting the choice)
  and keeps the merged weights, static caches and packs between calls.
- :mod:`.eligibility`: which requests the loop takes (greedy decoding and sampling of causal models); the others go
  to Hugging Face's ``generate``, which stays the reference (``llms.<name>.generation.decoder: hf``).
- :mod:`.batches`: the loop's batches (each prompt prefilled once per batch; rows and the key/value cache bounded).
- :mod:`.options`: :class:`~.options.DecodeOptions`, one batch's options (the request's and the decoder's), frozen.
- :mod:`.loop`: the loop itself, as gpt-fast writes it (``prefill``, ``decode_one_token``, ``decode_n_tokens``),
  returning each token's raw log-prob and its sampling log-prob.
- :mod:`.strategies`: how a batch's key/value cache is held and one step computed, one strategy per way (Hugging
  Face's dynamic cache, the static cache, the written-out step), each saying why it declines a batch.
- :mod:`.sampling`: how the loop draws one token per row from the processed distribution (``generation.sampler``).
- :mod:`.merged_lora`: the active LoRA adapter folded into a copy of the weights it touches, swapped in for decoding.
- :mod:`.static_step`: the static cache and the compiled decode step, with shapes bucketed.
- :mod:`.kept_weights`: under ZeRO-3, the gathered weights copied into buffers kept between calls, at fixed
  addresses (``generation.keep_gathered``).
- :mod:`.packed_linears`: linear layers packed once for a CPU's matmul kernel, MKL's or oneDNN's
  (``generation.pack_weights``).
- :mod:`.llama_step`: the decode step as plain tensor code, on CPUs (``generation.llama_step``), for the families
  whose record names their classes (:mod:`llmrl.engine.model.families`: Llama's layout, or Phi-3's packed
  projections read through its record).

This package does not plan batches, cut sequences at EOS or stops, or build the response
(:mod:`llmrl.engine.model.generation` does).
"""
