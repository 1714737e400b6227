"""Plain PyTorch / PEFT references the live updater tests compare llmrl against: a plain PEFT model of the tiny
LLaMA (r 4, alpha 8, every linear layer, as the lora initializer makes it), per-token passes over it, the token
value head's MLP written out, and the check that an update equals the reference step; plain models holding a run's
weights (one adapter's LoRA weights, or every weight) and their candidates' scores."""

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


def ppo_tokens_step(tiny, before: dict, prompts: list[str], conts, task_rewards, old, beta: float, args: dict,
                    lr: float) -> tuple[dict, float]:
    """One ``ppo_tokens`` update (one epoch, the whole batch, value head ``heads.value``) as plain PyTorch on a plain
    PEFT model, then one SGD step at ``lr``: the trained weights after it, and the batch's mean KL to the reference.
    ``task_rewards[i][j]`` is continuation j of prompt i's task reward per token (a scalar reward: zeros but the last
    token), added to ``-beta * (old - ref)``; GAE per continuation, advantages whitened over every token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    peft = peft_model(tiny, before)
    head_state = {k: v.clone().requires_grad_(True) for k, v in before.items() if k.startswith("heads.value.")}
    head = value_head(head_state, "heads.value")
    gamma, lam = args["gamma"], args["lam"]
    rows = []  # (i, j, old, values, advantages, returns, kl)
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            for j, cont in enumerate(conts[i]):
                _, _, h = token_pass(peft, tok, prompt, cont, hidden=True)
                values = head(h)
                with peft.disable_adapter():
                    ref, _, _ = token_pass(peft, tok, prompt, cont)
                o = torch.tensor(old[i][j])
                r = -beta * (o - ref) + torch.as_tensor(task_rewards[i][j], dtype=torch.float32)
                adv, running = torch.zeros(len(cont)), 0.0
                for t in reversed(range(len(cont))):
                    next_v = values[t + 1] if t + 1 < len(cont) else 0.0
                    running = r[t] + gamma * next_v - values[t] + gamma * lam * running
                    adv[t] = running
                rows.append([i, j, o, values, adv, adv + values, float((o - ref).sum())])
    flat = torch.cat([row[4] for row in rows])
    mean, std = flat.mean(), flat.std()
    for row in rows:
        row[4] = (row[4] - mean) / (std + 1e-8)
    params = trainable({f"model.{k}": p for k, p in peft.named_parameters()})
    params.update(head_state)
    per_prompt = [[] for _ in prompts]
    for i, j, o, old_v, adv, ret, _ in rows:
        logp, entropy, h = token_pass(peft, tok, prompts[i], conts[i][j], hidden=True)
        ratio = torch.exp(logp - o)
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - args["clip_eps"], 1 + args["clip_eps"]) * adv)
        v = head(h)
        v_clipped = old_v + torch.clamp(v - old_v, -args["value_clip"], args["value_clip"])
        vf = 0.5 * torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2)
        per_prompt[i].append((pg + args["value_coef"] * vf - args["entropy_coef"] * entropy).mean())
    loss = torch.stack([torch.stack(x).mean() for x in per_prompt]).mean()
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    loss.backward()
    opt.step()
    kl = sum(row[6] for row in rows) / len(rows)
    return {k: p.detach().clone() for k, p in params.items()}, kl


def lora_weights(state: dict, adapter: str) -> dict:
    """``{peft name: tensor}`` of one adapter in a run's state dict, named as a plain PEFT model with that adapter
    as ``default`` names it."""
    marker = f".{adapter}."
    return {k[len("model."):].replace(marker, ".default."): v for k, v in state.items() if marker in k and "lora_" in k}


def plain_model(tiny, weights: dict):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    return model.eval()


def plain_scores(model, contexts, candidates) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for context, options in zip(contexts, candidates):
            scores = []
            for candidate in options:
                full = torch.tensor([context + candidate])
                logp = torch.log_softmax(model(input_ids=full).logits[0].float(), -1)
                scores.append(sum(logp[len(context) + t - 1, tok] for t, tok in enumerate(candidate)))
            out.append(torch.stack(scores))
    return out


def plain_full_model(tiny, state: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    return model
