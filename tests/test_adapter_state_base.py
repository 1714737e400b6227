"""An adapter state (``save_adapter``, Tinker's ``save_state``) records a sample of the base weights its LoRA layers
adapt, and loading it where the base model differs is refused: its weights were trained against other weights.
The same base model served in bfloat16 passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.model.training.adapter_state import _check_base, base_sample
from testkit import tiny_model


def adapted(seed: int, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", seed=seed), dtype=dtype)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def served(model, name: str):
    return SimpleNamespace(model=model, llm=SimpleNamespace(name="b", model=name))


def test_a_state_saved_on_another_base_model_is_refused_and_the_same_one_in_bfloat16_passes():
    saved_on = adapted(0)
    state = {"model": "llama-seed0", "base": base_sample(saved_on, "default")}
    assert len(state["base"]) == 4 and all(v.shape == (16,) for v in state["base"].values())
    _check_base(served(adapted(0), "llama-seed0"), "default", "state", state)
    _check_base(served(adapted(0, torch.bfloat16), "llama-seed0"), "default", "state", state)
    with pytest.raises(ValueError, match=r"trained on another base model \('llama-seed0'; LLM 'b' serves "
                                         r"'llama-seed1'\): the base weights of .*q_proj differ"):
        _check_base(served(adapted(1), "llama-seed1"), "default", "state", state)
    _check_base(served(adapted(1), "llama-seed1"), "default", "state", {"model": "old"})  # saved before: unchecked


def test_the_sample_of_a_weight_over_2_to_the_24_entries_stays_in_bounds_and_ends_at_its_last_entry():
    """An output layer of 49,152 x 576 (SmolLM2's): float32 rounds its last index, 28,311,551, up to its length."""
    layer = torch.nn.Module()
    layer.scaling = {"default": 1.0}
    layer.base_layer = torch.nn.Linear(1, 1, bias=False)
    weight = torch.zeros(49152 * 576, dtype=torch.bfloat16)
    weight[-1], weight[0] = 7.0, 3.0
    layer.base_layer.weight = torch.nn.Parameter(weight.view(49152, 576), requires_grad=False)
    sample = base_sample(layer, "default")[""]
    assert sample.shape == (16,) and float(sample[0]) == 3.0 and float(sample[-1]) == 7.0
