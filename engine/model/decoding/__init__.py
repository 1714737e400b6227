"""llmrl's own decoding loop for ``generate``: one prefill per prompt, a preallocated key/value cache, the LoRA
adapter merged into sampling weights, and on CUDA the decode step captured once per shape bucket.

- :mod:`.eligibility`: which requests the loop takes (greedy decoding and sampling of causal models); the others go
  to Hugging Face's ``generate``, which stays the reference (``llms.<name>.generation.decoder: hf``).
- :mod:`.batches`: the loop's batches (each prompt prefilled once per batch; rows and the key/value cache bounded).
- :mod:`.merged_lora`: the active LoRA adapter folded into a copy of the weights it touches, swapped in for decoding.
- :mod:`.static_step`: the static cache and the compiled decode step, with shapes bucketed.
- :mod:`.loop`: the loop itself, returning each token's raw log-prob and its sampling log-prob.

This package does not plan batches, cut sequences at EOS or stops, or build the response
(:mod:`llmrl.engine.model.generation` does).
"""
