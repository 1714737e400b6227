"""The logits of the token after each context (``ForwardOutputs.context_logits``), from the last hidden state the
scoring pass already keeps there, for heads that declare ``needs_context_logits`` (the built-in ``next_token``).

A causal model's logits at a position are its output layer applied to the last layer's hidden state there; T5 with
tied embeddings (``scale_decoder_outputs``) scales that state by ``d_model ** -0.5`` first. So the logits after a
context cost one output-layer call on ``[n_contexts, H]``, whatever the candidates, and are those of
``model(ids).logits[:, -1]`` (seq2seq: of the decoder's first position). Models whose forward changes the logits
after the output layer (soft-capping, a logit scale) or whose last hidden state is not the output layer's input are
refused by name (:func:`context_logits_problem`) rather than served approximately: only the families listed in
with ``plain_output`` in :mod:`~llmrl.engine.model.families` are served (Llama, GPT-2 and T5 are tested against
plain Hugging Face).

This module makes one output-layer call and nothing else; which positions are the contexts' last is the scoring
code's business.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.families import family_of, model_types_where
from llmrl.engine.model.scoring.normalise import at_least_float32
from llmrl.engine.model.scoring.vocab_chunks import output_layer


def _base_config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def _t5_scales(config) -> bool:
    """Whether T5 scales its decoder's output before the output layer: ``scale_decoder_outputs`` (transformers 5), or
    tied embeddings (transformers 4, where the one decided the other)."""
    scale = getattr(config, "scale_decoder_outputs", None)
    return bool(getattr(config, "tie_word_embeddings", True) if scale is None else scale)


def context_logits_problem(model) -> str | None:
    """Why the logits after a context cannot be computed exactly for ``model`` from its last hidden state, or None."""
    config = _base_config(model)
    kind = getattr(config, "model_type", None)
    if not family_of(kind).plain_output:
        served = ", ".join(model_types_where("plain_output"))
        return (f"the logits after the context are served for the model types {served}, "
                f"not {kind!r} (its logits may not be its output layer applied to the last hidden state); score "
                "candidates=[[\"\"]] with add_eos=True and a token-level head with needs_logits instead")
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return (f"model type {kind!r} rescales its logits after the output layer; use a token-level head with "
                "needs_logits")
    if output_layer(model) is None:
        return f"model type {kind!r} has no output embeddings (get_output_embeddings() is None)"
    return None


def context_logits(model, last_hidden: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]`` float32 logits from ``[n, H]`` last-layer hidden states (those at each context's last token)."""
    config = _base_config(model)
    layer = output_layer(model)
    hidden = last_hidden
    if config.model_type == "t5" and _t5_scales(config):
        hidden = hidden * (config.d_model ** -0.5)  # as T5ForConditionalGeneration does before its lm_head
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.is_floating_point():
        hidden = hidden.to(weight.dtype)
    return at_least_float32(layer(hidden))
