"""Whether every layer of a model attends over the whole context with positions it reads from the inputs: what
packed scoring rows and the key/value cache kept across calls rely on.

Packed rows (:mod:`llmrl.engine.model.scoring.packed`) put several contexts and candidates in one row under a 4-D
attention mask of llmrl's own, with each token's position id; the cache across calls
(:mod:`llmrl.engine.model.reuse.prefix_cache`) hands keys computed in one call to another. Hugging Face's models
take such a mask as given (``_preprocess_mask_arguments`` returns a 4-D mask unchanged), so a layer that should see
less than the whole context silently sees all of it, and a layer whose state does not go through attention at all
carries one segment into the next. Measured on tiny random models (transformers 5.24) against scoring each
candidate alone, packed scores were off by up to 7.4 nats (Starcoder2's window), 7.2 (Llama 4's chunks), 3.2
(Jamba's Mamba layers) and 0.2 (MPT's ALiBi, whose bias is built from column indices). :func:`why_not_whole_context`
names the reason for:

- a sliding attention window on some layer (Mistral, Phi-3, Starcoder2, Gemma 2 and 3, Cohere 2, gpt-oss; Qwen2
  and Qwen3 only where ``layer_types`` says so), GPT-Neo's local layers, chunked attention (Llama 4);
- layers that are not attention (Mamba, convolution or linear-attention layers of hybrid models: LFM2, Jamba,
  Granite 4.0-H, Qwen3-Next, Falcon-H1, Zamba 2), and state-space or recurrent models;
- ALiBi (MPT, Bloom, Falcon with ``alibi``);
- and, for the cache across calls only, rotary frequencies that depend on the longest position in a call
  (``longrope``, ``dynamic``): keys kept from one call would be reused under other frequencies.

Such models score unpacked, each row as Hugging Face computes it, and refuse ``kv_cache_mb``; a model that keeps
state outside attention also encodes each context with each candidate (:func:`keeps_state_outside_attention`: its
cache cannot repeat a context's rows). This module reads configs; it runs nothing.
"""

from __future__ import annotations

from llmrl.engine.model.families import family_of

_ATTENTION_LAYERS = {"full_attention", "attention", "global"}
_WINDOWED_LAYERS = {"sliding_attention", "chunked_attention", "local"}


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_kinds(text) -> set[str]:
    kinds = set()
    for name in ("layer_types", "layers_block_type", "attention_layers"):  # (GPT-Neo's: "global" / "local")
        value = getattr(text, name, None)
        if isinstance(value, (list, tuple)):
            kinds |= {kind for kind in value if isinstance(kind, str)}
    return kinds


def _rope_types(text) -> set:
    """The rotary types of the config, also where they are given per layer type (Gemma 3's nested parameters)."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return set()
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return {part.get("rope_type", part.get("type")) for part in [rope, *nested]}


def keeps_state_outside_attention(config) -> bool:
    """Whether some layer carries state along the sequence outside attention (Mamba, convolution, linear attention,
    recurrent layers): such a cache cannot repeat a context's rows for its candidates, so contexts are not shared."""
    text = _text(config)
    model_type = str(getattr(text, "model_type", "") or "")
    other_kinds = _layer_kinds(text) - _ATTENTION_LAYERS - _WINDOWED_LAYERS
    return family_of(model_type).state_outside_attention or bool(other_kinds)


def why_not_whole_context(config, *, across_calls: bool = False) -> str | None:
    """None when every layer attends over the whole context and reads positions from the inputs; else the reason
    (see the module's docstring). ``across_calls``: keys are also kept from one call to the next."""
    from llmrl.engine.model.decoding.eligibility import slides_within

    text = _text(config)
    model_type = str(getattr(text, "model_type", "") or "")
    kinds = _layer_kinds(text)
    if keeps_state_outside_attention(text):
        return f"layers that are not attention over the context ({model_type}: {sorted(kinds) or 'recurrent'})"
    longest = getattr(text, "max_position_embeddings", None) or 2**62  # (Phi-3.5's 262,144 window never bites)
    if slides_within(text, longest) or kinds & _WINDOWED_LAYERS or getattr(text, "attention_chunk_size", None):
        return "attention over a sliding window or chunks on some layers"
    if family_of(model_type).alibi or getattr(text, "alibi", False):
        return "ALiBi position biases"
    varying = _rope_types(text) & {"longrope", "dynamic"}
    if across_calls and varying:
        return f"{'/'.join(sorted(varying))} rotary frequencies, which depend on the longest position in a call"
    return None
