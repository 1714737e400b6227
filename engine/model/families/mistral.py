"""The Mistral family (``model_type`` ``mistral``): Llama's layout, served by the written-out decode step; a
configured ``sliding_window`` applies to every layer (whatever ``layer_types`` says); a plain output layer.
Registers its record; it loads no model and imports transformers only when the decode step asks for the classes."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, StepClasses, register


def step_classes() -> StepClasses:
    from transformers.models.mistral import modeling_mistral as m

    return StepClasses(m.MistralForCausalLM, m.MistralModel, m.MistralDecoderLayer, m.MistralAttention, m.MistralMLP,
                       m.MistralRMSNorm)


MISTRAL = register(Family(name="Mistral", model_types=("mistral",), step_classes=step_classes, plain_output=True))
