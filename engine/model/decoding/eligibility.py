"""Which ``generate`` requests llmrl's decoding loop takes, and why it declines the others.

The loop runs greedy decoding and sampling of causal models, with every logits processor Hugging Face would apply
for the request's arguments (it builds them with Hugging Face's own code), ``stop`` strings and token ids, and any
number of return sequences. It declines beam search and the other decoding modes, seq2seq models, models with layers
that are not attention (Mamba, convolution: hybrids such as LFM2 or Jamba), user-supplied ``logits_processor`` /
``stopping_criteria`` objects, other arguments (or fields of the model's generation config) and ZeRO-3 groups in
lockstep. Prompts that read the key/value cache across calls (``kv_cache_mb``) run in the loop too: it prefills only
what the cache does not hold. :func:`why_not` names the reason; the caller then runs Hugging Face's ``generate``
(decoder ``auto``) or refuses the request (decoder ``llmrl``).

This module decides nothing else; it runs no model.
"""

from __future__ import annotations

from llmrl.engine.model.families import family_of

# Arguments whose meaning the loop reproduces: the length limits, the sampling settings (applied by Hugging Face's
# own processors, built from them), the special tokens and the row count.
TAKEN = frozenset({
    "max_new_tokens", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "num_return_sequences", "pad_token_id",
    "eos_token_id", "bos_token_id", "use_cache", "renormalize_logits", "remove_invalid_values",
})


# Fields of a model's generation config that change nothing the loop computes (llmrl sets the outputs it reads)
INERT_CONFIG_FIELDS = frozenset({
    "transformers_version", "_from_model_config", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "cache_implementation",
    "max_length",  # every request sets max_new_tokens, which wins over it (in the loop as in generate)
})


def config_fields(generation_config) -> dict:
    """The fields a model's generation config sets away from Hugging Face's defaults, less the inert ones: the loop
    must reproduce them as it does a request's arguments (a shipped ``forced_eos_token_id``, say)."""
    return {k: v for k, v in generation_config.to_diff_dict().items() if k not in INERT_CONFIG_FIELDS}


def why_not(kind: str, kwargs: dict, *, stepwise: bool, synced: bool, zero3: bool, recurrent: bool = False,
            configured: dict | None = None) -> str | None:
    """None when llmrl's loop can run this request; else the reason it cannot, in a phrase. ``recurrent``: the model
    keeps state outside attention (:func:`~llmrl.engine.model.attention_span.keeps_state_outside_attention`);
    ``configured``: the model's generation config's own fields (:func:`config_fields`)."""
    if kind != "causal":
        return "the model is seq2seq (the loop decodes causal models)"
    if recurrent:
        return "the model has layers that are not attention (the loop repeats and grows attention caches only)"
    if not stepwise:
        return "the request is not greedy decoding or sampling (beam search and the other modes run in Hugging Face)"
    if synced:
        return "the replicas of a ZeRO-3 group decode in lockstep"
    if zero3:
        return "the weights are partitioned by ZeRO-3"
    other = sorted(k for k in kwargs if k not in TAKEN)
    if other:
        return f"argument(s) {other} (the loop takes {', '.join(sorted(TAKEN))})"
    fields = sorted(k for k in configured or {} if k not in TAKEN)
    if fields:
        return f"the model's generation config sets {fields} (the loop takes {', '.join(sorted(TAKEN))})"
    return None


def slides_within(config, length: int) -> bool:
    """Whether some attention layer of the model sees only a sliding window shorter than ``length`` tokens."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not window or window >= length:
        return False
    # a family whose layers read ``layer_types`` (built from ``use_sliding_window`` and ``max_window_layers``); others,
    # Mistral among them, apply a configured window to every layer whatever those fields say
    if not family_of(getattr(text, "model_type", None)).window_by_layer_types:
        return True
    kinds = getattr(text, "layer_types", None)
    return "sliding_attention" in kinds if kinds is not None else bool(getattr(text, "use_sliding_window", True))
