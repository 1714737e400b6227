"""What :class:`~llmrl.engine.model.hf_backend.HFBackend`'s start-up derives from a loaded Hugging Face model and the
LLM's config: the number of hidden states heads may read (:func:`num_hidden_states`), the token a seq2seq decoder
starts from (:func:`decoder_start_id`), and the stores that live across calls, each refused with the config key to
change when the model cannot serve it: the cache across calls (:func:`make_prefix_cache`) and the frozen trunk
(:func:`make_trunk`).

This module loads nothing and serves no request; the backend calls it while it prepares and builds.
"""

from __future__ import annotations

import torch


def make_prefix_cache(model, llm):
    """The cache across calls for ``llms.<name>.kv_cache_mb``; refuses models whose layers do not all attend over
    the whole context, or whose keys depend on the call (:mod:`llmrl.engine.model.attention_span`)."""
    from llmrl.engine.errors import ConfigError
    from llmrl.engine.model.attention_span import why_not_whole_context
    from llmrl.engine.model.reuse.prefix_cache import PrefixKVCache, model_bytes_per_token

    reason = why_not_whole_context(model.config, across_calls=True)
    if reason is not None:
        raise ConfigError([(f"llms.{llm.name}.kv_cache_mb",
                            f"this model's keys cannot be kept across calls: {reason}; the cache across calls needs "
                            "full attention over the whole context on every layer: set it to 0")])
    return PrefixKVCache(int(llm.kv_cache_mb * 2**20), model_bytes_per_token(model.config, getattr(torch, llm.dtype)))


def make_trunk(model, llm, depth: int, trainable: bool):
    """The frozen-trunk store for ``llms.<name>.trunk_reuse_mb``; refuses models with nothing frozen to reuse."""
    from llmrl.engine.errors import ConfigError
    from llmrl.engine.model.reuse.trunk import Trunk, decoder_layers

    layers = decoder_layers(model)
    where = f"llms.{llm.name}.trunk_reuse_mb"
    if layers is None:
        raise ConfigError([(where, f"this model ({type(model).__name__}) keeps no decoder layers where frozen-trunk "
                                   "reuse looks (model.layers, as Llama, Qwen2, Mistral do): set it to 0")])
    if not trainable:  # an updater from the config or handed to the Caller by the script, or trainable: true
        raise ConfigError([(where, "frozen-trunk reuse serves updates and this LLM is not trained (no updater, "
                                   "trainable not set): set it to 0")])
    if not 0 < depth < len(layers):
        raise ConfigError([(where, f"the first trainable (or adapted) layer is {depth}: nothing below it to reuse; "
                                   "train only the top layers (lora's last_layers, or the freeze initializer) or set "
                                   "it to 0")])
    return Trunk(model, depth, int(llm.trunk_reuse_mb * 2**20))


def num_hidden_states(model, kind: str) -> int:
    """Entries of Hugging Face's ``hidden_states`` (seq2seq: ``decoder_hidden_states``): the embeddings and one per
    (decoder) layer."""
    config = model.config.get_text_config()
    if kind == "seq2seq":
        layers = getattr(config, "num_decoder_layers", None) or getattr(config, "decoder_layers", None)
        if layers:
            return layers + 1
    return config.num_hidden_layers + 1


def decoder_start_id(model) -> int | None:
    """The token a seq2seq decoder starts from: the model config's, else its generation config's (some models,
    BART's descendants among them, keep it only there)."""
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None and getattr(model, "generation_config", None) is not None:
        start = model.generation_config.decoder_start_token_id
    return start
