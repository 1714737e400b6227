"""Plain PyTorch / PEFT references the live updater tests compare llmrl against: a plain PEFT model of the tiny
LLaMA (r 4, alpha 8, every linear layer, as the lora initializer makes it), per-token passes over it, the token
value head's MLP written out, and the check that an update equals the reference step."""

from __future__ import annotations

import torch


def peft_model(tiny, state: dict):
    """A plain PEFT model (r 4, alpha 8, every linear layer, as the lora initializer makes it) holding ``state``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():
        for key, p in peft.named_parameters():
            p.copy_(state[f"model.{key}"])
    return peft


def token_pass(model, tok, prompt: str, cont: list[int], hidden: bool = False):
    """Per-token log-probs and entropies of ``cont`` after ``prompt`` (and the last-layer hidden states at the
    positions predicting them)."""
    ctx = tok(prompt)["input_ids"]
    out = model(input_ids=torch.tensor([ctx + cont]), output_hidden_states=hidden)
    logp = torch.log_softmax(out.logits[0, len(ctx) - 1:-1].float(), -1)
    chosen = logp[torch.arange(len(cont)), torch.tensor(cont)]
    entropy = -(logp.exp() * logp).sum(-1)
    states = out.hidden_states[-1][0, len(ctx) - 1:-1] if hidden else None
    return chosen, entropy, states


def value_head(state: dict, prefix: str):
    def head(h):
        w0, b0 = state[f"{prefix}.mlp.0.weight"], state[f"{prefix}.mlp.0.bias"]
        w2, b2 = state[f"{prefix}.mlp.2.weight"], state[f"{prefix}.mlp.2.bias"]
        return (torch.tanh(h @ w0.T + b0) @ w2.T + b2).squeeze(-1)
    return head


def trainable(named: dict) -> dict:
    return {k: p for k, p in named.items() if ".lora_" in k or k.startswith("heads.")}


def check_step(after: dict, expected: dict, before: dict) -> None:
    moved = 0
    for key, want in expected.items():
        torch.testing.assert_close(after[key], want, atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        moved += int((want - before[key]).abs().max() > 1e-4)
    assert moved >= len(expected) // 2, f"only {moved} of {len(expected)} trained tensors moved"
    frozen = [k for k in before if k not in expected]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen), "the base model is frozen"
