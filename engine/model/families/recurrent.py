"""The models that keep state along the sequence outside attention, by ``model_type``: state-space and recurrent
models (Mamba, RWKV, xLSTM, RecurrentGemma) and hybrids of attention with Mamba, convolution or linear-attention
layers (LFM2, Jamba, Zamba, Falcon-H1, Bamba, Granite 4.0-H, Qwen3-Next, Nemotron-H, PLaMo 2, MiniMax). Their
caches cannot repeat a context's rows, and packed rows or the cache across calls would carry one segment into the
next (:mod:`~llmrl.engine.model.attention_span`); hybrids whose config lists their layer kinds are found from those
too. One record for them all (they share every fact llmrl keeps); it loads no model."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, register

RECURRENT = register(Family(
    name="state outside attention", state_outside_attention=True,
    model_types=("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe", "jamba",
                 "zamba", "zamba2", "falcon_h1", "bamba", "granitemoehybrid", "qwen3_next", "nemotron_h", "plamo2",
                 "minimax")))
