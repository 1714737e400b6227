"""Seq2seq policies (a tiny T5: the encoder reads the prompt, the decoder writes the continuation) in the ``sft``,
``dpo``, ``grpo`` and ``ppo_tokens`` (with a token value head on the decoder's hidden states) updaters: one update
equals a plain SGD step on a plain PEFT T5, whose decoder reads the model's decoder start token and then the
continuation's tokens (what ``score`` does for seq2seq models), and ``generate`` (Hugging Face's loop for seq2seq)
feeds ``grpo`` its samples.

Tolerance: 1e-5 on parameters after SGD steps; most trained parameters must move by more than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.models import decoder_start
from testkit.plain import check_step

pytestmark = pytest.mark.slow

LR = 0.05
PROMPTS = ["translate: the red ball", "translate: open the door", "translate: a wall ahead"]
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
PPO = {"kl_coef": 0.1, "whiten": False, "gamma": 1.0, "lam": 1.0, "epochs": 1, "value_clip": None, "value_coef": 0.5}


@pytest.fixture(scope="module")
def run(tiny):
    def llm(plugin, args):
        return {"model": tiny["t5"], "type": "seq2seq", "replicas": 2, "initializers": [LORA],
                "updater": {"plugin": plugin, "args": args},
                "training": {"zero_stage": 2, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": 8}}

    ppo = {**llm("ppo_tokens", PPO), "heads": {"value": {"plugin": "token_value", "args": {"hidden": 8}}}}
    live = LiveRun({"llms": {"sft": llm("sft", {}), "dpo": llm("dpo", {"beta": 0.5}),
                             "grpo": llm("grpo", {"kl_coef": 0.1, "loss": "token"}), "ppo": ppo},
                    "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def plain_t5(tiny, state: dict):
    """A plain PEFT T5 (r 4, alpha 8, every linear layer, as the lora initializer makes it) holding ``state``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny["t5"]).eval()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for key, p in peft.named_parameters():
            p.copy_(state[f"model.{key}"])
    return peft


def token_logprobs(model, tok, prompt: str, cont: list[int], hidden: bool = False):
    """Each token's log-prob (and, with ``hidden``, the decoder's last hidden state at the position predicting it)."""
    enc = tok(prompt, return_tensors="pt")
    decoder = torch.tensor([[decoder_start(model)] + cont[:-1]])
    out = model(**enc, decoder_input_ids=decoder, output_hidden_states=hidden)
    logp = torch.log_softmax(out.logits[0].float(), -1)[torch.arange(len(cont)), torch.tensor(cont)]
    return (logp, out.decoder_hidden_states[-1][0]) if hidden else logp


def stepped(model) -> dict:
    return {f"model.{k}": (p - LR * p.grad).detach() for k, p in model.named_parameters() if p.requires_grad}


def test_sft_on_t5_equals_a_plain_step(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["t5"])
    targets = [[tok.encode(w, add_special_tokens=False)] for w in ("le ballon rouge", "ouvre la porte", "un mur")]
    before = run.state_dict(llm="sft")
    run.update(PROMPTS, targets, llm="sft")
    model = plain_t5(tiny, before)
    logps = [token_logprobs(model, tok, p, t[0] + [tok.eos_token_id]) for p, t in zip(PROMPTS, targets)]
    (-torch.cat(logps).mean()).backward()
    check_step(run.state_dict(llm="sft"), stepped(model), before)


def test_dpo_on_t5_equals_a_plain_step(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["t5"])
    pairs = [[tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)]
             for a, b in (("oui", "non merci"), ("la porte", "le mur"), ("un mur", "une balle"))]
    run.update(PROMPTS, [[r, c] for c, r in pairs], llm="dpo")  # away from the reference first
    before = run.state_dict(llm="dpo")
    run.update(PROMPTS, pairs, llm="dpo")
    model = plain_t5(tiny, before)
    losses = []
    for prompt, (chosen, rejected) in zip(PROMPTS, pairs):
        with torch.no_grad(), model.disable_adapter():
            ref = [float(token_logprobs(model, tok, prompt, c).sum()) for c in (chosen, rejected)]
        pol = [token_logprobs(model, tok, prompt, c).sum() for c in (chosen, rejected)]
        losses.append(-torch.nn.functional.logsigmoid(0.5 * ((pol[0] - ref[0]) - (pol[1] - ref[1]))))
    torch.stack(losses).mean().backward()
    check_step(run.state_dict(llm="dpo"), stepped(model), before)


def test_grpo_on_t5_samples_from_generate_and_equals_a_plain_step(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["t5"])
    rewards = [[1.0, 0.0, 0.5], [0.2, 0.9, -0.4], [0.0, 1.0, 2.0]]
    away = [[[5, 6], [7], [8, 9, 10]]] * 3  # one update first: LoRA's B leaves zero, so A has gradients too
    run.update(PROMPTS, away, llm="grpo", rewards=rewards)
    groups = run.generate(PROMPTS, llm="grpo", max_new_tokens=5, do_sample=True, num_return_sequences=3, seed=1)
    conts = [[s["tokens"].tolist() for s in group] for group in groups]
    old = [[s["logprobs"] for s in group] for group in groups]
    before = run.state_dict(llm="grpo")
    model = plain_t5(tiny, before)
    for prompt, group in zip(PROMPTS, groups):  # generate's log-probs are the plain model's
        for sample in group:
            torch.testing.assert_close(sample["logprobs"], token_logprobs(model, tok, prompt,
                                                                          sample["tokens"].tolist()).detach(),
                                       atol=1e-5, rtol=0)
    run.update(PROMPTS, conts, llm="grpo", rewards=rewards, old_logprobs=old)
    loss = _grpo_token_loss(model, tok, conts, rewards, old)
    loss.backward()
    check_step(run.state_dict(llm="grpo"), stepped(model), before)


def test_ppo_tokens_on_t5_with_a_token_value_head_equals_a_plain_step(run, tiny):
    """KL-penalised per-token rewards against the adapters-off model, the token value head on the decoder's hidden
    states, GAE with gamma = lambda = 1 (advantage: the rewards still to come minus V), unwhitened."""
    from testkit.plain import value_head

    tok = t5_tokenizer(tiny)
    rewards = [[1.0, -0.5], [0.3, 0.8], [-1.0, 0.2]]
    conts = [[[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [[14], [15, 16]]]
    run.update(PROMPTS, conts, llm="ppo", rewards=[[-r for r in rs] for rs in rewards])  # away from the reference
    before = run.state_dict(llm="ppo")
    model = plain_t5(tiny, before)
    with torch.no_grad():
        old = [[token_logprobs(model, tok, p, c).tolist() for c in group] for p, group in zip(PROMPTS, conts)]
    run.update(PROMPTS, conts, llm="ppo", rewards=rewards, old_logprobs=old)
    head_state = {k: v.clone().requires_grad_(True) for k, v in before.items() if k.startswith("heads.value.")}
    head = value_head(head_state, "heads.value")
    per_prompt = []
    for prompt, group, rs, olds in zip(PROMPTS, conts, rewards, old):
        per_cont = []
        for cont, reward, o in zip(group, rs, olds):
            logp, h = token_logprobs(model, tok, prompt, cont, hidden=True)
            with torch.no_grad(), model.disable_adapter():
                ref = token_logprobs(model, tok, prompt, cont)
            r = -0.1 * (torch.tensor(o) - ref)
            r[-1] += reward
            values = head(h)
            returns = r.flip(0).cumsum(0).flip(0)
            advantages = returns - values.detach()
            ratio = torch.exp(logp - torch.tensor(o))
            per_cont.append((-ratio * advantages + 0.5 * 0.5 * (values - returns) ** 2).mean())
        per_prompt.append(torch.stack(per_cont).mean())
    torch.stack(per_prompt).mean().backward()
    expected = {**stepped(model), **{k: (p - LR * p.grad).detach() for k, p in head_state.items()}}
    check_step(run.state_dict(llm="ppo"), expected, before)


def t5_tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["t5"])


def _grpo_token_loss(model, tok, conts, rewards, old) -> torch.Tensor:
    """GRPO with ``loss: token`` and a KL estimator (coefficient 0.1) to the base model: within a prompt every token
    of its group weighs the same; prompts are then averaged."""
    per_prompt = []
    for prompt, group, rs, olds in zip(PROMPTS, conts, rewards, old):
        r = torch.tensor(rs)
        advantages = (r - r.mean()) / (r.std() + 1e-4)
        total, count = 0.0, 0
        for cont, a, o in zip(group, advantages, olds):
            logp = token_logprobs(model, tok, prompt, cont)
            with torch.no_grad(), model.disable_adapter():
                ref = token_logprobs(model, tok, prompt, cont)
            ratio = torch.exp(logp - torch.as_tensor(o))
            policy = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            total, count = total + (policy + 0.1 * kl).sum(), count + len(cont)
        per_prompt.append(total / count)
    return torch.stack(per_prompt).mean()
