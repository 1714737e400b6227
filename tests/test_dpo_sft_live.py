"""The ``dpo`` and ``sft`` updaters on live servers (2 replicas, LoRA, uneven shares 3/2) against plain PyTorch on a
plain PEFT model, written out here:

- ``dpo``: one update equals a plain SGD step of DPO's loss with the model's adapters disabled as the reference;
  with ``ipo`` and the reference log-probs given by the client, of IPO's loss on per-token means; its statistics
  equal the plain implicit rewards; a prompt without exactly two continuations is refused and nothing trains.
- ``sft``: one update equals a plain SGD step of the mean negative log-likelihood of every target token (EOS
  appended) over both replicas.

Tolerance: 1e-5 on parameters after SGD steps; most trained parameters must move by more than 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import check_step, peft_model, token_pass
from testkit.texts import LORA, PROMPTS, WORDS

pytestmark = pytest.mark.slow

LR = 0.05


def sgd() -> dict:
    return {"zero_stage": 2, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": 8}


@pytest.fixture(scope="module")
def run(tiny):
    llms = {name: {"model": tiny["llama"], "replicas": 2, "initializers": [LORA], "training": sgd(),
                   "updater": {"plugin": plugin, "args": args}}
            for name, plugin, args in (("dpo", "dpo", {"beta": 0.5}), ("ipo", "dpo", {"beta": 0.5, "loss": "ipo"}),
                                       ("sft", "sft", {}))}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def pairs(tok) -> list[list[list[int]]]:
    """Per prompt, token ids of a chosen and a rejected continuation."""
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [[encode(WORDS[i % len(WORDS)]), encode(WORDS[(i + 3) % len(WORDS)])[:2 + i % 2]]
            for i in range(len(PROMPTS))]


def away_from_base(run, llm: str, tok) -> None:
    """One update first, so that the policy differs from the reference (the base model)."""
    run.update(PROMPTS, [[p[1], p[0]] for p in pairs(tok)], llm=llm)


def test_dpo_update_equals_a_plain_sgd_step_with_the_base_model_as_reference(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    away_from_base(run, "dpo", tok)
    data = pairs(tok)
    before = run.state_dict(llm="dpo")
    stats = run.update(PROMPTS, data, llm="dpo")
    assert [s["samples"] for s in stats] == [3, 2]
    model = peft_model(tiny, before)
    losses, margins = [], []
    for prompt, (chosen, rejected) in zip(PROMPTS, data):
        with torch.no_grad(), model.disable_adapter():
            ref = [float(token_pass(model, tok, prompt, c)[0].sum()) for c in (chosen, rejected)]
        pol = [token_pass(model, tok, prompt, c)[0].sum() for c in (chosen, rejected)]
        h = (pol[0] - ref[0]) - (pol[1] - ref[1])
        losses.append(-torch.nn.functional.logsigmoid(0.5 * h))
        margins.append(float(0.5 * h.detach()))
    mean_loss = torch.stack(losses).mean()
    assert stats[0]["loss"] * 3 / 5 + stats[1]["loss"] * 2 / 5 == pytest.approx(float(mean_loss.detach()), abs=1e-5)
    mine = (stats[0]["reward_margin"] * 3 + stats[1]["reward_margin"] * 2) / 5
    assert mine == pytest.approx(sum(margins) / len(margins), abs=1e-5)
    assert stats[0]["reward_accuracy"] * 3 + stats[1]["reward_accuracy"] * 2 == sum(m > 0 for m in margins)
    mean_loss.backward()
    expected = {f"model.{k}": (p - LR * p.grad).detach() for k, p in model.named_parameters() if p.requires_grad}
    check_step(run.state_dict(llm="dpo"), expected, before)


def test_ipo_with_given_reference_logprobs_equals_a_plain_sgd_step(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    data = pairs(tok)
    given = [[-1.5 - 0.1 * i, -2.0 + 0.05 * i] for i in range(len(PROMPTS))]  # per-token means, the client's
    before = run.state_dict(llm="ipo")
    run.update(PROMPTS, data, llm="ipo", ref_logprobs=given)
    model = peft_model(tiny, before)
    losses = []
    for prompt, (chosen, rejected), ref in zip(PROMPTS, data, given):
        pol = [token_pass(model, tok, prompt, c)[0].mean() for c in (chosen, rejected)]
        losses.append(((pol[0] - ref[0]) - (pol[1] - ref[1]) - 1 / (2 * 0.5)) ** 2)
    torch.stack(losses).mean().backward()
    expected = {f"model.{k}": (p - LR * p.grad).detach() for k, p in model.named_parameters() if p.requires_grad}
    check_step(run.state_dict(llm="ipo"), expected, before)


def test_dpo_refuses_prompts_without_a_pair_and_keeps_serving(run, tiny):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="dpo")
    with pytest.raises(RequestError, match="two continuations per prompt.*prompt 1 has 3"):
        run.update(PROMPTS[:2], [[[5, 6], [7]], [[7, 8], [9], [10]]], llm="dpo")
    with pytest.raises(RequestError, match="ref_logprobs"):
        run.update(PROMPTS[:2], [[[5, 6], [7]], [[7, 8], [9]]], llm="dpo", ref_logprobs=[[0.0, 1.0], [0.0]])
    after = run.state_dict(llm="dpo")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert len(run.score(PROMPTS[:1], [[" a"]], llm="dpo")) == 1


def test_sft_update_equals_a_plain_sgd_step_of_the_token_mean_nll(run, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    targets = [[tok.encode(WORDS[(i * 2) % len(WORDS)], add_special_tokens=False)[:1 + i]] for i in range(5)]
    before = run.state_dict(llm="sft")
    stats = run.update(PROMPTS, targets, llm="sft")
    model = peft_model(tiny, before)
    nll, count = 0.0, 0
    for prompt, (target,) in zip(PROMPTS, targets):
        logp = token_pass(model, tok, prompt, target + [tok.eos_token_id])[0]
        nll, count = nll - logp.sum(), count + len(logp)
    assert [s["tokens"] for s in stats] == [sum(len(t[0]) + 1 for t in targets[:3]),
                                             sum(len(t[0]) + 1 for t in targets[3:])]
    loss = nll / count  # every target token of both replicas weighs the same
    assert (stats[0]["loss"] * stats[0]["tokens"] + stats[1]["loss"] * stats[1]["tokens"]) / count == \
        pytest.approx(float(loss.detach()), abs=1e-5)
    loss.backward()
    expected = {f"model.{k}": (p - LR * p.grad).detach() for k, p in model.named_parameters() if p.requires_grad}
    check_step(run.state_dict(llm="sft"), expected, before)


def test_sft_refuses_a_prompt_without_a_target_and_keeps_serving(run):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="sft")
    with pytest.raises(RequestError, match="at least one target per prompt"):
        run.update(PROMPTS[:2], [[[5, 6]], []], llm="sft")  # the second replica's prompt has none
    after = run.state_dict(llm="sft")
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was trained"
    assert len(run.score(PROMPTS[:1], [[" a"]], llm="sft")) == 1
