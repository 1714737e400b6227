"""Activation (gradient) checkpointing of the layers an update trains, exact with llmrl's key/value caches.

With ``training.gradient_checkpointing``, every transformer layer from the first one that holds a trained weight (a
LoRA adapter, an unfrozen layer) upward keeps only its inputs during a forward pass with gradients, and computes its
activations again when the backward pass reaches it (``torch.utils.checkpoint``, non-reentrant). A training pass
then holds each such layer's input instead of every activation inside it; the price is one more forward of those
layers per backward. The layers below (a frozen trunk, which keeps no activation for the backward pass anyway, and
whose computation frozen-trunk reuse may skip) are left alone. Scoring, generation and the first phase of a split
micro-batch run without gradients and are never checkpointed.

Why not Hugging Face's own switch (``gradient_checkpointing_enable``): it acts only in training mode, and llmrl
serves in evaluation mode (no dropout, scores equal to plain inference); and it drops the key/value cache of the
checkpointed layers, which llmrl's passes read (a candidate row attends to its context's cache). Here the layer's
cache is put back as it was before the layer ran, before the layer is computed again, so the recomputation appends
the same keys and values once and reads the same cache: gradients equal those without checkpointing.

The layers are the modules Hugging Face itself marks as checkpointable (``GradientCheckpointingLayer``: the decoder
layers of Llama, Qwen, Mistral, GPT-2, the blocks of T5, ...). This module does not decide whether to checkpoint
(the config does, see the schema's ``gradient_checkpointing``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from llmrl.engine.model.reuse.hf_kv import layer_cache


def checkpointable_layers(model) -> list[torch.nn.Module]:
    """The model's layers Hugging Face marks as checkpointable, in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def trained_layers(model) -> list[torch.nn.Module]:
    """The checkpointable layers from the first one holding a trained weight (or a LoRA adapter) upward."""
    layers = checkpointable_layers(model)
    for k, layer in enumerate(layers):
        if any(p.requires_grad or "lora_" in name for name, p in layer.named_parameters()):
            return layers[k:]
    return []


def enable_checkpointing(model) -> int:
    """Checkpoint the trained layers of ``model`` in every forward pass with gradients; returns how many."""
    layers = trained_layers(model)
    for layer in layers:
        replaced = vars(layer).get("forward")
        layer.forward = _checkpointed(layer.forward, own=getattr(replaced, "same_without_grad", replaced is None))
    return len(layers)


def _checkpointed(forward, own: bool = True):
    """``forward`` checkpointed when gradients are on. ``own``: it is the layer's class's forward (not one replaced
    on the instance), so that without gradients the layer computes what its class does."""
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        restore = cache_restorer(_cache_among(args, kwargs))

        def compute(*inputs):
            restore()  # a no-op in the forward pass; in the backward pass, the cache as this layer first found it
            return forward(*inputs, **kwargs)

        return checkpoint(compute, *args, use_reentrant=False)

    run.same_without_grad = own  # without gradients, the layer's own forward (decoding.llama_step may skip it)
    return run


def _cache_among(args: tuple, kwargs: dict):
    """The key/value cache a layer was handed, by name or by position (GPT-2's blocks take it second)."""
    from transformers.cache_utils import Cache

    named = layer_cache(kwargs)
    if named is not None:
        return named
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Cache)), None)


def cache_restorer(cache):
    """A function that puts ``cache`` (a Hugging Face key/value cache, or None) back as it is now."""
    if cache is None:
        return lambda: None
    held = []  # (a cache's list of layers, its layers now, each layer's attributes now)
    for part in (cache, getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)):
        layers = getattr(part, "layers", None)
        if isinstance(layers, list):
            held.append((layers, list(layers), [dict(vars(layer)) for layer in layers]))
    flags = getattr(cache, "is_updated", None)
    flags_now = dict(flags) if isinstance(flags, dict) else None
    if not held:
        raise TypeError(f"gradient checkpointing cannot restore a {type(cache).__name__} key/value cache; set "
                        "training.gradient_checkpointing to false for this model")

    def restore():
        for layers, now, states in held:
            layers[:] = now
            for layer, state in zip(now, states):
                vars(layer).clear()
                vars(layer).update(state)
        if flags_now is not None:
            flags.clear()
            flags.update(flags_now)

    return restore
