"""The tiny Llama with four LoRA adapters of random weights (B too: each changes the model's outputs), the tenants of
the multi-LoRA batching tests (test_row_adapters.py: generate; test_token_adapters.py: forward and backward).

red, green and blue: rank 4 on q, v, up and down; teal: rank 2 on q and o (o: teal's alone; up and down: not teal's).
``blue_on_output``: blue adapts the output layer too (which reads the kept positions only)."""

from __future__ import annotations

import torch

MLP_AND_ATTENTION = ["q_proj", "v_proj", "up_proj", "down_proj"]


def four_adapters(reference_models, blue_on_output: bool = False):
    """(PEFT model in eval mode, tokenizer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model, tok = reference_models["llama"]
    torch.manual_seed(0)
    base = LlamaForCausalLM(type(model.config)(**model.config.to_dict())).eval()
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=MLP_AND_ATTENTION)
    peft_model = get_peft_model(base, config, adapter_name="red")
    peft_model.add_adapter("green", config)
    peft_model.add_adapter("blue", LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        *MLP_AND_ATTENTION, *(["lm_head"] if blue_on_output else [])]))
    peft_model.add_adapter("teal", LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                              target_modules=["q_proj", "o_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    return peft_model.eval(), tok
