"""The Qwen2 family: Qwen2 (``qwen2``: Llama's layout with biased query/key/value projections, served by the
written-out decode step, a plain output layer) and Qwen2-MoE (``qwen2_moe``: neither). Both read ``layer_types``
to decide which layers slide. Registers their records; it loads no model and imports transformers only when the
decode step asks for the classes."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, StepClasses, register


def step_classes() -> StepClasses:
    from transformers.models.qwen2 import modeling_qwen2 as m

    return StepClasses(m.Qwen2ForCausalLM, m.Qwen2Model, m.Qwen2DecoderLayer, m.Qwen2Attention, m.Qwen2MLP,
                       m.Qwen2RMSNorm)


QWEN2 = register(Family(name="Qwen2", model_types=("qwen2",), step_classes=step_classes, window_by_layer_types=True,
                        plain_output=True))
QWEN2_MOE = register(Family(name="Qwen2-MoE", model_types=("qwen2_moe",), window_by_layer_types=True))
