"""Build the DeepSpeed config of one LLM from its llmrl config: a pure function, tested as data.

The generated config sets the batch geometry (micro-batch x accumulation x replicas), the ZeRO
stage, gradient clipping, the precision, and AutoTP when the LLM is tensor-parallel. The optimizer
is not declared here: the engine passes a plain torch optimizer (DeepSpeed's own Adam JIT-compiles
a kernel, which needs a compiler and minutes on CPU). ``training.deepspeed`` is merged last, for
experts who need a key llmrl does not expose.
"""

from __future__ import annotations

import copy
from typing import Any

from llmrl.engine.config import LLMConfig


def build_deepspeed_config(llm: LLMConfig) -> dict[str, Any]:
    training = llm.training
    zero: dict[str, Any] = {"stage": training.zero_stage}
    if training.zero_stage == 3:
        # Exports need whole weights; gathering them on save is what makes Caller.save's export possible.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "gradient_clipping": float(training.gradient_clipping),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # The trainer owns the accumulation boundary: it steps after every `gradient_accumulation_steps`
        # micro-steps and also closes a shorter last group, so no gradient is carried into the next update.
        "managed_gradient_accumulation": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": llm.dtype == "bfloat16"},
        "fp16": {"enabled": llm.dtype == "float16"},
    }
    if llm.tensor_parallel > 1:
        config["tensor_parallel"] = {"autotp_size": llm.tensor_parallel}
    return deep_merge(config, training.deepspeed)


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
