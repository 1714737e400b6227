"""The ``ilql`` and ``nlpo`` updaters and their steered sampling on live servers (2 replicas, LoRA, uneven shares
3/2) against plain PyTorch on a plain PEFT model, written out here:

- ``ilql``: one update equals a plain SGD step of ILQL's loss (Q, expectile V, CQL and likelihood terms, each token
  of both replicas weighing the same, also over 3 accumulated micro-steps) on the LoRA weights and the Q and V
  heads; the target Q heads move by Polyak averaging and nothing else; ``generate(steer=...)``'s greedy tokens are
  the argmax of ``log_softmax(logits) + beta * (min targetQ - V)`` computed from a plain forward.
- ``nlpo``: after one update (which snapshots the masking policy first), the next equals a plain SGD step of the
  policy gradient under the masked distribution (the masking policy's top-p set, taken tokens and special tokens
  in); ``generate(steer=True)``'s greedy tokens are the policy's argmax within the masking policy's set and its
  ``sampling_logprobs`` are the masked log-probs; sampled tokens never leave the set.

Tolerance: 1e-5 on parameters after SGD steps and on log-probs.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import check_step, peft_model, token_pass
from testkit.texts import LORA, PROMPTS, WORDS

pytestmark = pytest.mark.slow

LR = 0.05
ILQL = {"gamma": 0.9, "tau": 0.7, "cql_scale": 0.1, "awac_scale": 1.0, "alpha": 0.25, "sync_every": 1, "beta": 2.0}
NLPO = {"kl_coef": 0.3, "value_head": None, "whiten": False, "gamma": 1.0, "lam": 1.0, "epochs": 1, "top_p": 0.5,
        "mask_sync_every": 100}


@pytest.fixture(scope="module")
def run(tiny):
    training = {"zero_stage": 2, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": 8}
    llms = {"ilql": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA], "training": training,
                     "heads": {"ilql": {"plugin": "ilql", "args": {"hidden": 16}}},
                     "updater": {"plugin": "ilql", "args": ILQL}},
            # one optimizer step of 3 micro-steps per replica (shares 3/2: replica 1's last is empty)
            "ilql-acc": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA],
                         "training": {**training, "micro_batch_size": 1, "gradient_accumulation_steps": 3},
                         "heads": {"ilql": {"plugin": "ilql", "args": {"hidden": 16}}},
                         "updater": {"plugin": "ilql", "args": ILQL}},
            "nlpo": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA], "training": training,
                     "updater": {"plugin": "nlpo", "args": NLPO}}}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["llama"])


def continuations(tok) -> list[list[list[int]]]:
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [[encode(WORDS[i % len(WORDS)]), encode(WORDS[(i + 2) % len(WORDS)])[:1 + i % 3]]
            for i in range(len(PROMPTS))]


def plain_head(state: dict, prefix: str, requires_grad: bool = True):
    """trlX's head (Linear, ReLU, Linear) written out from its weights; returns the function and its tensors."""
    params = {k: state[f"{prefix}.{k}"].clone().requires_grad_(requires_grad) for k in
              ("0.weight", "0.bias", "2.weight", "2.bias")}

    def head(h):
        return torch.relu(h @ params["0.weight"].T + params["0.bias"]) @ params["2.weight"].T + params["2.bias"]
    return head, params


@pytest.mark.parametrize("llm", ["ilql", "ilql-acc"])
def test_ilql_update_equals_a_plain_sgd_step_and_moves_the_targets_by_polyak(run, tiny, tok, llm):
    """Also with gradient accumulation: the step's tokens all weigh the same (each micro-step divided by its own
    tokens before) and the targets move once, after the optimizer step (after each micro-step before)."""
    data = continuations(tok)
    rewards = [[1.0 - 0.3 * i, -0.5 + 0.2 * i] for i in range(len(PROMPTS))]
    fresh = run.state_dict(llm=llm)
    assert all(float(fresh[k].abs().max()) == 0 for k in fresh if k.startswith("heads.ilql.") and ".2." in k), \
        "every Q and V starts at 0"
    run.update(PROMPTS, data, llm=llm, rewards=[[-r for r in rs] for rs in rewards])  # LoRA's B and the heads
    before = run.state_dict(llm=llm)  # leave zero: every trained tensor has a gradient next
    stats = run.update(PROMPTS, data, llm=llm, rewards=rewards)
    assert [s["samples"] for s in stats] == [3, 2]
    assert all(m["updater_bytes"] == 0 for m in run.server_memory().values())  # float32 targets: no copies
    model = peft_model(tiny, before)
    q = [plain_head(before, f"heads.ilql.q_heads.{i}") for i in range(2)]
    target = [plain_head(before, f"heads.ilql.target_q_heads.{i}", False)[0] for i in range(2)]
    v, v_params = plain_head(before, "heads.ilql.v_head")
    total, tokens = 0.0, 0
    for prompt, conts, rs in zip(PROMPTS, data, rewards):
        for cont, reward in zip(conts, rs):
            logp, _, h = token_pass(model, tok, prompt, cont, hidden=True)
            actions = torch.tensor(cont)
            values = v(h).squeeze(-1)
            for t in range(len(cont)):  # one action at a time, as the paper writes the loss
                after = values[t + 1].detach() if t + 1 < len(cont) else 0.0
                goal = (reward if t == len(cont) - 1 else 0.0) + ILQL["gamma"] * after
                qs = [head(h[t])[actions[t]] for head, _ in q]
                best = min(float(head(h[t].detach())[actions[t]]) for head in target)
                gap = best - values[t]
                total = total + sum((x - goal) ** 2 for x in qs) \
                    + (0.7 if gap.item() >= 0 else 0.3) * gap ** 2 \
                    + 0.1 * sum(-torch.log_softmax(head(h[t]), -1)[actions[t]] for head, _ in q) - logp[t]
                tokens += 1
    loss = total / tokens
    assert sum(s["loss"] * s["tokens"] for s in stats) / tokens == pytest.approx(loss.item(), abs=1e-5)
    loss.backward()
    expected = {f"model.{k}": (p - LR * p.grad).detach() for k, p in model.named_parameters() if p.requires_grad}
    for name, params in [*[(f"q_heads.{i}", q[i][1]) for i in range(2)], ("v_head", v_params)]:
        expected.update({f"heads.ilql.{name}.{k}": (p - LR * p.grad).detach() for k, p in params.items()})
    for i in range(2):  # target <- alpha * Q (after the step) + (1 - alpha) * target
        for k in ("0.weight", "0.bias", "2.weight", "2.bias"):
            expected[f"heads.ilql.target_q_heads.{i}.{k}"] = \
                0.25 * expected[f"heads.ilql.q_heads.{i}.{k}"] + 0.75 * before[f"heads.ilql.target_q_heads.{i}.{k}"]
    check_step(run.state_dict(llm=llm), expected, before)


def test_ilql_steered_greedy_tokens_follow_the_advantages(run, tiny, tok):
    state = run.state_dict(llm="ilql")
    model = peft_model(tiny, state)
    target = [plain_head(state, f"heads.ilql.target_q_heads.{i}", False)[0] for i in range(2)]
    v, _ = plain_head(state, "heads.ilql.v_head", False)
    beta = 300.0  # the heads have had two small steps from zero: a large weight makes their advantages count
    out = run.generate(PROMPTS[:3], llm="ilql", steer={"beta": beta}, max_new_tokens=5, do_sample=False)
    plain_greedy = run.generate(PROMPTS[:3], llm="ilql", max_new_tokens=5, do_sample=False)
    differs = 0
    for prompt, samples, plain in zip(PROMPTS, out, plain_greedy):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            for _ in range(5):
                o = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
                h = o.hidden_states[-1][0, -1]
                adv = torch.minimum(target[0](h), target[1](h)) - v(h).squeeze(-1)
                ids = ids + [int((torch.log_softmax(o.logits[0, -1], -1) + beta * adv).argmax())]
        assert [int(x) for x in samples[0]["tokens"]] == ids[-5:]
        differs += [int(x) for x in plain[0]["tokens"]] != ids[-5:]
    assert differs, "steering changed no greedy choice: the test would not see it missing"


def masked_pass(policy, masking, tok, prompt: str, cont: list[int], top_p: float, add_taken: bool = True):
    """The policy's log-probs of ``cont`` under the masking policy's top-p sets (special tokens in, and with
    ``add_taken`` the taken tokens), and the sets."""
    ids = torch.tensor([tok(prompt)["input_ids"] + cont])
    start = ids.shape[1] - len(cont) - 1
    logits = policy(input_ids=ids).logits[0, start:-1].float()
    with torch.no_grad():
        masking_probs = torch.softmax(masking(input_ids=ids).logits[0, start:-1].float(), -1)
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for t in range(len(cont)):
        order = masking_probs[t].argsort(descending=True)
        mass = 0.0
        for token in order.tolist():  # the likeliest first, until the mass reaches top_p
            allowed[t, token] = True
            mass += float(masking_probs[t, token])
            if mass >= top_p:
                break
        allowed[t, cont[t]] |= add_taken
        allowed[t, tok.all_special_ids] = True
    logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    return logp[torch.arange(len(cont)), torch.tensor(cont)], allowed


def test_nlpo_update_equals_a_plain_masked_policy_gradient_step(run, tiny, tok):
    data = continuations(tok)
    rewards = [[0.5 + 0.1 * i, -1.0 + 0.3 * i] for i in range(len(PROMPTS))]
    first = run.state_dict(llm="nlpo")  # the masking policy is snapshotted from these weights
    run.update(PROMPTS, data, llm="nlpo", rewards=rewards)
    before = run.state_dict(llm="nlpo")
    stats = run.update(PROMPTS, data, llm="nlpo", rewards=[[-r for r in rs] for rs in rewards])
    assert stats[0]["mask_syncs"] == 1 and 0 < stats[0]["mask_size"] < 320
    policy, masking = peft_model(tiny, before), peft_model(tiny, first)
    per_prompt, kl_sum, continuations_seen = [], 0.0, 0
    for prompt, conts, rs in zip(PROMPTS, data, rewards):
        per_cont = []
        for cont, reward in zip(conts, rs):
            logp, _ = masked_pass(policy, masking, tok, prompt, cont, NLPO["top_p"])
            with torch.no_grad():  # the KL penalty reads the unmasked policy against the reference, as RL4LMs
                raw, _, _ = token_pass(policy, tok, prompt, cont)
                with policy.disable_adapter():
                    ref, _, _ = token_pass(policy, tok, prompt, cont)
            per_token = -NLPO["kl_coef"] * (raw - ref)
            per_token[-1] += -reward  # the (negated) task reward on the last token
            advantage = per_token.flip(0).cumsum(0).flip(0)  # gamma = lam = 1, no critic: the rewards to go
            ratio = torch.exp(logp - logp.detach())
            per_cont.append((-ratio * advantage).mean())
            kl_sum, continuations_seen = kl_sum + float((raw - ref).sum()), continuations_seen + 1
        per_prompt.append(torch.stack(per_cont).mean())
    # (with the masked log-probs it read 2.18 here, against -0.08: log of the top-p set's mass on every token)
    assert stats[0]["batch_kl"] == pytest.approx(kl_sum / continuations_seen, abs=1e-5)
    torch.stack(per_prompt).mean().backward()
    expected = {f"model.{k}": (p - LR * p.grad).detach() for k, p in policy.named_parameters() if p.requires_grad}
    after = run.state_dict(llm="nlpo")
    check_step({k: v for k, v in after.items() if "nlpo_mask" not in k}, expected,
               {k: v for k, v in before.items() if "nlpo_mask" not in k})


def masking_state(state: dict) -> dict:
    """The served state with the masking snapshot's LoRA weights in the trained adapter's place."""
    return {**{k: v for k, v in state.items() if "lora_" not in k},
            **{k.replace("nlpo_mask", "default"): v for k, v in state.items() if "nlpo_mask" in k}}


def test_nlpo_steered_sampling_stays_in_the_masking_policys_set(run, tiny, tok):
    state = run.state_dict(llm="nlpo")
    assert any("nlpo_mask" in k for k in state), "the masking snapshot is served"
    policy, masking = peft_model(tiny, state), peft_model(tiny, masking_state(state))
    greedy = run.generate(PROMPTS[:3], llm="nlpo", steer={"top_p": 0.3}, max_new_tokens=4, do_sample=False)
    one_by_one = run.generate(PROMPTS[:3], llm="nlpo", steer={"top_p": 0.3}, max_new_tokens=4, do_sample=False,
                              minibatch_size=1)  # batches of one row: the masking policy's cache starts afresh
    assert [[int(x) for x in g[0]["tokens"]] for g in one_by_one] == [[int(x) for x in g[0]["tokens"]] for g in greedy]
    for prompt, samples in zip(PROMPTS, greedy):
        tokens = [int(x) for x in samples[0]["tokens"]]
        with torch.no_grad():
            logp, allowed = masked_pass(policy, masking, tok, prompt, tokens, 0.3, add_taken=False)
            ids = torch.tensor([tok(prompt)["input_ids"] + tokens])
            logits = policy(input_ids=ids).logits[0, -len(tokens) - 1:-1]
        assert tokens == logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
        torch.testing.assert_close(torch.as_tensor(samples[0]["sampling_logprobs"]).float(), logp, atol=1e-5, rtol=0)
    sampled = run.generate(PROMPTS, llm="nlpo", steer={"top_p": 0.05}, max_new_tokens=6, do_sample=True, seed=3,
                           num_return_sequences=2)
    unsteered = run.generate(PROMPTS, llm="nlpo", max_new_tokens=6, do_sample=True, seed=3, num_return_sequences=2)
    outside = 0
    for prompt, samples, plain in zip(PROMPTS, sampled, unsteered):
        for sample, other in zip(samples, plain):
            with torch.no_grad():
                mine, theirs = [int(x) for x in sample["tokens"]], [int(x) for x in other["tokens"]]
            with torch.no_grad():
                _, allowed = masked_pass(policy, masking, tok, prompt, mine, 0.05, add_taken=False)
                _, allowed_other = masked_pass(policy, masking, tok, prompt, theirs, 0.05, add_taken=False)
            assert all(bool(allowed[t, token]) for t, token in enumerate(mine))
            outside += sum(not bool(allowed_other[t, token]) for t, token in enumerate(theirs))
    assert outside, "unsteered samples never left the set: the test would not see the mask missing"


def test_steer_and_nlpo_refuse_bad_input_and_keep_serving(run):
    from llmrl.engine.errors import RequestError

    with pytest.raises(RequestError, match="steer must be true or a dict"):
        run.generate(PROMPTS[:1], llm="nlpo", steer="yes", max_new_tokens=2)
    with pytest.raises(RequestError, match="steer=.*unexpected keyword argument 'bogus'"):
        run.generate(PROMPTS[:1], llm="ilql", steer={"bogus": 1}, max_new_tokens=2)
    before = run.state_dict(llm="nlpo")
    with pytest.raises(RequestError, match=r"\['old_logprobs'\] are not read by the updater 'NLPOUpdater'"):
        run.update(PROMPTS[:2], [[[5, 6]], [[7]]], llm="nlpo", rewards=[[1.0], [0.0]], old_logprobs=[[[-1.0, -1.0]],
                                                                                                    [[-1.0]]])
    after = run.state_dict(llm="nlpo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert len(run.generate(PROMPTS[:1], llm="ilql", max_new_tokens=2)[0]) == 1
