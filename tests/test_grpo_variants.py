"""``grpo``'s loss variants, run in process on a bigram stand-in for the trainer (:mod:`testkit.bigram`) against the
loss written out in plain PyTorch here:

- ``clip_eps_high`` (DAPO's "clip higher"): the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``;
- ``loss: batch_token`` (TRL's ``bnpo`` / ``dapo``): every token of the optimizer step weighs the same, so
  micro-batch 1 x accumulation 3 equals micro-batch 3 x accumulation 1, however long each prompt's continuations;
- ``loss: fixed_length`` (Dr. GRPO): each continuation's token sum over the constant ``max_new_tokens``; a longer
  continuation, or a ``max_new_tokens`` without that loss, is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from testkit.bigram import BigramTrainer, batch, token_logps, two_replicas

CONTEXTS = [[1], [2], [4]]
# continuations of very different lengths, so that the normalisations differ
CONTINUATIONS = [[[0, 1, 2, 3, 4, 5], [3]], [[5, 0], [1, 2, 3], [4, 4, 4, 4]], [[2, 2, 2, 2, 2, 2, 2], [0]]]
REWARDS = [[1.0, 0.0], [0.2, 0.9, -0.5], [0.0, 2.0]]
KL_COEF = 0.1


def old_logprobs(W: torch.Tensor) -> list:
    """Old log-probs 0.25 away from the current ones, alternately up and down: ratios of e^-0.25 = 0.78 (even
    positions) and e^0.25 = 1.28 (odd ones); both leave [0.8, 1.2], only the first leaves [0.8, 1.3]."""
    return [[(token_logps(W, c, t).detach() + 0.25 * torch.tensor([(-1.0) ** k for k in range(len(t))])).tolist()
             for t in group] for c, group in zip(CONTEXTS, CONTINUATIONS)]


def plain_gradient(trainer: BigramTrainer, old: list, loss: str, clip_high: float = 0.2,
                   max_new_tokens: int = 0) -> torch.Tensor:
    """The documented loss of one step over all three prompts, written out token by token."""
    W = trainer.W.detach().clone().requires_grad_(True)
    per_prompt, all_tokens = [], []
    for c, group, rewards, olds in zip(CONTEXTS, CONTINUATIONS, REWARDS, old):
        r = torch.tensor(rewards)
        advantages = (r - r.mean()) / (r.std() + 1e-4)
        per_continuation = []
        for tokens, a, o in zip(group, advantages, olds):
            logp = token_logps(W, c, tokens)
            ratio = torch.exp(logp - torch.tensor(o))
            policy = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.0 + clip_high) * a)
            d = token_logps(trainer.W0, c, tokens) - logp
            per_token = policy + KL_COEF * (torch.exp(d) - d - 1)
            per_continuation.append(per_token)
            all_tokens.append(per_token)
        if loss == "sequence":
            per_prompt.append(torch.stack([t.mean() for t in per_continuation]).mean())
        elif loss == "fixed_length":
            per_prompt.append(torch.stack([t.sum() / max_new_tokens for t in per_continuation]).mean())
        else:  # token: the group's tokens
            per_prompt.append(torch.cat(per_continuation).mean())
    total = torch.cat(all_tokens).mean() if loss == "batch_token" else torch.stack(per_prompt).mean()
    total.backward()
    return W.grad


def run_grpo(trainer: BigramTrainer, old: list, accumulation: int = 1, **args) -> tuple[dict, torch.Tensor]:
    """One grpo update; the gradient of the step (the sum of its micro-steps', all in one step here)."""
    from llmrl.plugins.grpo import GRPOUpdater

    updater = GRPOUpdater(epochs=1, kl_coef=KL_COEF, **args)
    stats = updater.update(replace(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, old_logprobs=old),
                                   accumulation_steps=accumulation), trainer)
    return stats, sum(g[0] for g in trainer.grads)


@pytest.mark.parametrize("clip_high", [None, 0.3])
def test_clip_eps_high_raises_the_upper_clip_only(clip_high):
    trainer = BigramTrainer()
    old = old_logprobs(trainer.W)
    stats, got = run_grpo(trainer, old, clip_eps_high=clip_high)
    torch.testing.assert_close(got, plain_gradient(trainer, old, "sequence", clip_high or 0.2), atol=1e-6, rtol=0)
    # the tokens at odd positions (ratio 1.28) are clipped at 0.2, not at 0.3; the even ones (0.78) either way
    tokens = sum(len(t) for group in CONTINUATIONS for t in group)
    low = sum((k % 2 == 0) for group in CONTINUATIONS for t in group for k in range(len(t)))
    assert stats["clip_fraction"] == pytest.approx((tokens if clip_high is None else low) / tokens, abs=1e-6)


@pytest.mark.parametrize("micro, accumulation", [(3, 1), (1, 3), (2, 2)])
def test_batch_token_weighs_every_token_of_the_step_the_same_whatever_the_micro_steps(micro, accumulation):
    trainer = BigramTrainer(micro_batch_size=micro)
    old = old_logprobs(trainer.W)
    _, got = run_grpo(trainer, old, accumulation, loss="batch_token")
    expected = plain_gradient(trainer, old, "batch_token")
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # the variants are not the same loss on these lengths: the test tells them apart
    assert float((expected - plain_gradient(trainer, old, "token")).abs().max()) > 1e-3


def test_fixed_length_divides_each_continuation_by_max_new_tokens():
    trainer = BigramTrainer()
    old = old_logprobs(trainer.W)
    _, got = run_grpo(trainer, old, loss="fixed_length", max_new_tokens=8)
    torch.testing.assert_close(got, plain_gradient(trainer, old, "fixed_length", max_new_tokens=8), atol=1e-6, rtol=0)


def test_fixed_length_refuses_a_continuation_longer_than_max_new_tokens():
    trainer = BigramTrainer()
    with pytest.raises(ValueError, match="prompt 2 has a continuation of 7 tokens, more than grpo's max_new_tokens 6"):
        run_grpo(trainer, old_logprobs(trainer.W), loss="fixed_length", max_new_tokens=6)
    assert not trainer.grads


@pytest.mark.parametrize("args", [{"loss": "fixed_length"}, {"loss": "sequence", "max_new_tokens": 8}])
def test_max_new_tokens_goes_with_fixed_length_only(args):
    from llmrl.plugins.grpo import GRPOUpdater

    with pytest.raises(ValueError, match="max_new_tokens is the divisor of loss: fixed_length"):
        GRPOUpdater(**args)


def test_batch_token_weighs_every_token_the_same_across_two_replicas():
    """Prompts 0 and 1 (13 tokens) on one replica, prompt 2 (8 tokens) on the other: the replicas' gradients,
    averaged as DeepSpeed averages them, equal the plain loss over the 21 tokens."""
    from llmrl.plugins.grpo import GRPOUpdater

    reference = BigramTrainer()
    old = old_logprobs(reference.W)
    whole = batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, old_logprobs=old)
    grads = two_replicas(whole, [[0, 1], [2]], lambda: BigramTrainer(micro_batch_size=2),
                         lambda: GRPOUpdater(epochs=1, kl_coef=KL_COEF, loss="batch_token"))
    torch.testing.assert_close((grads[0] + grads[1]) / 2, plain_gradient(reference, old, "batch_token"),
                               atol=1e-6, rtol=0)
