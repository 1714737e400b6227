"""The Qwen3 family: Qwen3 (``qwen3``: Llama's layout plus a norm of each query and key head, served by the
written-out decode step, a plain output layer) and Qwen3-MoE (``qwen3_moe``: neither). Both read ``layer_types``
to decide which layers slide. Registers their records; it loads no model and imports transformers only when the
decode step asks for the classes."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, StepClasses, register


def step_classes() -> StepClasses:
    from transformers.models.qwen3 import modeling_qwen3 as m

    return StepClasses(m.Qwen3ForCausalLM, m.Qwen3Model, m.Qwen3DecoderLayer, m.Qwen3Attention, m.Qwen3MLP,
                       m.Qwen3RMSNorm)


QWEN3 = register(Family(name="Qwen3", model_types=("qwen3",), step_classes=step_classes, window_by_layer_types=True,
                        plain_output=True))
QWEN3_MOE = register(Family(name="Qwen3-MoE", model_types=("qwen3_moe",), window_by_layer_types=True))
