"""The Llama family (``model_type`` ``llama``: Llama 1-3, SmolLM, TinyLlama, ...): the layout the written-out decode
step was written for, a plain output layer, its decoder layers in ``model.layers``. Registers its record; it loads
no model and imports transformers only when the decode step asks for the classes."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, StepClasses, register


def step_classes() -> StepClasses:
    from transformers.models.llama import modeling_llama as m

    return StepClasses(m.LlamaForCausalLM, m.LlamaModel, m.LlamaDecoderLayer, m.LlamaAttention, m.LlamaMLP,
                       m.LlamaRMSNorm)


LLAMA = register(Family(name="Llama", model_types=("llama",), step_classes=step_classes, plain_output=True))
