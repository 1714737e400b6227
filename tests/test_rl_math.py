"""The shared RL maths (plugins/rl_math.py) and the keep-in-graph zeros (engine/graph.py) against values computed by
hand: the clipped surrogate, the value loss in its three forms, the KL estimators, whitening, the per-prompt means;
and the property the zeros exist for (a backward reaches the tied tensors, with gradient 0, and no value moves)."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.engine.graph import graph_zero, keep_in_graph, plus_zero
from llmrl.plugins.rl_math import (
    approx_kl,
    clipped_surrogate,
    kl_k3,
    mean_and_std,
    per_prompt_mean,
    per_prompt_token_mean,
    refuse_whitening_one,
    value_loss,
    whiten,
    whiten_stats,
)


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32),
                               atol=atol, rtol=0)


def test_clipped_surrogate_by_hand():
    # eps 0.2. ratio 1.5, A = +2: min(3.0, 1.2 * 2 = 2.4) = 2.4 -> loss -2.4, clipped.
    # ratio 0.5, A = +2: min(1.0, 0.8 * 2 = 1.6) = 1.0 -> loss -1.0, clipped (the flag counts the ratio, not the min).
    # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, clipped.  ratio 1.1, A = 3: inside: loss -3.3.
    ratio = torch.tensor([1.5, 0.5, 1.5, 1.1])
    advantages = torch.tensor([2.0, 2.0, -1.0, 3.0])
    loss, clipped = clipped_surrogate(ratio, advantages, 0.2)
    close(loss, [-2.4, -1.0, 1.5, -3.3])
    close(clipped, [1.0, 1.0, 1.0, 0.0])
    # advantages broadcast per row: [n] -> [n, 1] against [n, T]
    loss, _ = clipped_surrogate(torch.tensor([[1.0, 2.0], [0.5, 1.0]]), torch.tensor([[1.0], [-2.0]]), 0.2)
    close(loss, [[-1.0, -1.2], [1.6, 2.0]])


def test_clipped_surrogate_flags_are_detached_and_the_loss_is_not():
    ratio = torch.tensor([1.5, 1.0], requires_grad=True)
    loss, clipped = clipped_surrogate(ratio, torch.tensor([1.0, 1.0]), 0.2)
    assert loss.requires_grad and not clipped.requires_grad
    loss.sum().backward()
    close(ratio.grad, [0.0, -1.0])  # the clipped branch carries no gradient, the other -A


def test_value_loss_in_its_three_forms():
    values, returns, old = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([0.5, 0.5])
    like = torch.ones(2)
    close(value_loss(None, returns, old, 0.2, like), [0.0, 0.0])  # no critic
    close(value_loss(values, returns, None, 0.2, like), [0.5, 2.0])  # 0.5 (V - R)^2
    close(value_loss(values, returns, old, None, like), [0.5, 2.0])
    # clip 0.2 around old 0.5: V 1.0 -> 0.7, (0.7 - 0)^2 = 0.49 < (1 - 0)^2 = 1: 0.5 * 1 = 0.5; V 0.0 -> 0.3,
    # (0.3 - 2)^2 = 2.89 < (0 - 2)^2 = 4: 0.5 * 4 = 2.0. The clipped term wins for V 2.0, R 2.0, old 1.0: V -> 1.2,
    # 0.5 * max(0, (1.2 - 2)^2 = 0.64) = 0.32.
    close(value_loss(values, returns, old, 0.2, like), [0.5, 2.0])
    close(value_loss(torch.tensor([2.0]), torch.tensor([2.0]), torch.tensor([1.0]), 0.2, like[:1]), [0.32])


def test_kl_estimators_by_hand():
    # approx_kl(log r) = (r - 1) - log r: log r = log 2 -> 1 - 0.693147 = 0.306853; log r = 0 -> 0.
    close(approx_kl(torch.tensor([math.log(2.0), 0.0])), [1.0 - math.log(2.0), 0.0])
    # k3: d = ref - logp; exp(d) - d - 1: d = 1 -> e - 2 = 0.718282; d = -1 -> 1/e = 0.367879; d = 0 -> 0.
    close(kl_k3(torch.tensor([0.0, 0.0, -2.0]), torch.tensor([1.0, -1.0, -2.0])), [math.e - 2.0, 1.0 / math.e, 0.0])


def test_whitening_by_hand():
    values = torch.tensor([[1.0, 3.0, 99.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    stats = whiten_stats(values, mask)
    close(stats, [3.0, 9.0, 35.0])  # count, sum, sum of squares of 1, 3, 5
    mean, std = mean_and_std(stats + whiten_stats(torch.tensor([[7.0]]), torch.tensor([[True]])))
    # 1, 3, 5, 7: mean 4, unbiased variance (9 + 1 + 1 + 9) / 3 = 20 / 3
    assert mean == 4.0 and abs(std - math.sqrt(20.0 / 3.0)) < 1e-12
    close(whiten(values, mask, 3.0, 2.0, eps=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert mean_and_std(torch.zeros(3, dtype=torch.float64)) == (0.0, 1.0)
    # one value: its standard deviation is 0 and its whitened value 0, whatever it was; refused by name
    one = whiten_stats(torch.tensor([[2.5]]), torch.tensor([[True]]))
    mean, std = mean_and_std(one)
    assert whiten(torch.tensor([[2.5]]), torch.tensor([[True]]), mean, std).item() == 0.0
    with pytest.raises(ValueError, match="whiten: the batch holds a single token.*whiten: false"):
        refuse_whitening_one(float(one[0]), "token")
    for count in (0.0, 2.0, 7.0):
        refuse_whitening_one(count, "token")


def test_per_prompt_means_weigh_continuations_or_tokens():
    # prompt 0: continuations with tokens [1, 3] and [5]; prompt 1: one continuation [2, 2, 2]
    per_token = torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    context = torch.tensor([0, 0, 1])
    close(per_prompt_token_mean(per_token, mask, context, 2), [3.0, 2.0])  # (1 + 3 + 5) / 3, 6 / 3
    close(per_prompt_mean(torch.tensor([2.0, 5.0, 2.0]), context, 2), [3.5, 2.0])  # continuations weigh the same



def test_aggregate_weighs_tokens_continuations_and_prompts_by_mode():
    from llmrl.plugins.rl_math import aggregate

    per_token = torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0], [2.0, 2.0, 2.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [False, False, False]])
    context = torch.tensor([0, 0, 1, 1])  # the last continuation has no real token

    close(aggregate(per_token, mask, "sequence", context, 2), [3.5, 1.0])  # (2 + 5) / 2, (2 + 0) / 2
    close(aggregate(per_token, mask, "token", context, 2), [3.0, 2.0])  # (1 + 3 + 5) / 3, 6 / 3
    close(aggregate(per_token, mask, "fixed_length", context, 2, max_new_tokens=4), [1.125, 0.75])  # (4/4 + 5/4) / 2
    close(aggregate(per_token, mask, "batch_token", context, 2, step_tokens=30.0, num_replicas=2), 1.0)  # 15 * 2/30
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'.*'fixed_length'"):
        aggregate(per_token, mask, "mean", context, 2)


def test_the_clipped_surrogate_on_epsilons_is_the_one_on_ratio_bounds():
    from llmrl.plugins.rl_math import clipped_ratio_loss

    ratio, advantages = torch.rand(50) * 2, torch.randn(50)
    loss, clipped = clipped_surrogate(ratio, advantages, 0.2, 0.28)
    assert torch.equal(loss, clipped_ratio_loss(ratio, advantages, 0.8, 1.28))
    assert torch.equal(clipped, ((ratio < 0.8) | (ratio > 1.28)).float())

def test_an_empty_replica_still_reaches_the_weights():
    weight = torch.tensor([2.0, 3.0], requires_grad=True)
    for mean in (lambda empty: per_prompt_mean(empty, torch.zeros(0, dtype=torch.long), 0),
                 lambda empty: per_prompt_token_mean(empty.reshape(0, 1), torch.zeros((0, 1), dtype=torch.bool),
                                                     torch.zeros(0, dtype=torch.long), 0)):
        weight.grad = None
        mean = mean(weight[:0] * 1.0)  # what a replica without samples computes
        assert mean.shape == (0,)
        mean.sum().backward()
        close(weight.grad, [0.0, 0.0])  # reached, with gradient zero


def test_graph_zeros_change_no_value_and_keep_the_dtype():
    source = torch.tensor([1.0, -4.0], requires_grad=True)
    value = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)
    kept = keep_in_graph(value, source)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, value) and kept.requires_grad
    kept.float().sum().backward()
    close(source.grad, [0.0, 0.0])
    zero = graph_zero(torch.ones(2, requires_grad=True), torch.ones(3, dtype=torch.bfloat16))
    assert zero.dim() == 0 and float(zero.detach()) == 0.0 and zero.dtype == torch.float32
    assert plus_zero(None, zero) is None
    tied = plus_zero({1: torch.ones(2), 2: torch.zeros(1)}, zero)
    assert sorted(tied) == [1, 2] and all(t.requires_grad for t in tied.values())
    close(tied[1], [1.0, 1.0])


def test_token_losses_by_hand():
    from llmrl.plugins.rl_math import token_loss

    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    sampler = torch.tensor([-1.0, -1.0, -1.0])  # ratios 1, e^0.5 = 1.6487, e^-1 = 0.3679
    adv = torch.tensor([2.0, 1.0, -1.0])
    inputs = {"logprobs": sampler, "advantages": adv, "weights": torch.tensor([0.0, 1.0, 2.0])}
    r1, r2 = math.exp(0.5), math.exp(-1.0)
    close(token_loss("cross_entropy", logp, inputs), [0.0, 0.5, 4.0])
    close(token_loss("importance_sampling", logp, inputs), [-2.0, -r1, r2])
    # ppo: token 2's ratio 1.6487 > 1.2 with A = 1: min(1.6487, 1.2) -> 1.2; token 3's 0.3679 < 0.8 with A = -1:
    # min(-0.3679, -0.8) -> -0.8 (the clipped, more pessimistic one)
    close(token_loss("ppo", logp, inputs), [-2.0, -1.2, 0.8])
    close(token_loss("ppo", logp, inputs, {"clip_low_threshold": 0.3, "clip_high_threshold": 2.0}), [-2.0, -r1, r2])
    # cispo: the clipped ratio (1, 1.2, 0.8) weighs A x logp, with no gradient of its own
    cispo = token_loss("cispo", logp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    close(cispo, [-2.0 * -1.0, -1.2 * -0.5, -0.8 * 2.0])
    grad, = torch.autograd.grad(cispo.sum(), logp)
    close(grad, [-2.0, -1.2, 0.8])
    # by default one-sided, as Tinker's (0 and 4): the ratios 1, 1.6487 and 0.3679 weigh it unclipped; 6 is capped
    grad, = torch.autograd.grad(token_loss("cispo", logp, inputs).sum(), logp)
    close(grad, [-2.0, -r1, r2])
    far = {**inputs, "logprobs": torch.tensor([-1.0, -1.0, -2.0 - math.log(6.0)])}
    grad, = torch.autograd.grad(token_loss("cispo", logp, far).sum(), logp)
    close(grad, [-2.0, -r1, 4.0])
    # dro: -(logp A - beta/2 (logp - sampler)^2), beta 0.1
    close(token_loss("dro", logp, inputs, {"beta": 0.1}), [2.0, 0.5 + 0.05 * 0.25, -2.0 + 0.05 * 1.0])
    # gspo over tokens 1-2 only: s = exp(mean(0, 0.5)) = e^0.25 = 1.2840 on every token, each with its own gradient
    s = math.exp(0.25)
    gspo_inputs = {**inputs, "sequence_ratio_mask": torch.tensor([1.0, 1.0, 0.0])}
    gspo = token_loss("gspo", logp, gspo_inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    close(gspo, [-2.0 * s, -1.0 * s, s])  # inside the clip range: -s A
    grad, = torch.autograd.grad(gspo.sum(), logp)
    close(grad, [-2.0 * s, -1.0 * s, s])  # d(-s_t A_t)/dlogp_t = -s A_t: token 3 (outside the mask) too
    # at the default thresholds s > 1.2: A > 0 takes the clipped 1.2 (no gradient), A < 0 keeps s
    gspo = token_loss("gspo", logp, gspo_inputs)
    close(gspo, [-2.0 * 1.2, -1.2, s])
    grad, = torch.autograd.grad(gspo.sum(), logp)
    close(grad, [0.0, 0.0, s])
    nothing_marked = token_loss("gspo", logp, {**inputs, "sequence_ratio_mask": torch.zeros(3)})
    close(nothing_marked, [-2.0, -1.0, 1.0])  # no marked token: s = 1


def test_token_losses_refuse_bad_input_by_name():
    from llmrl.plugins.rl_math import token_loss

    logp = torch.zeros(3)
    good = {"logprobs": torch.zeros(3), "advantages": torch.ones(3)}
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'.*'cispo'"):
        token_loss("grpo", logp, good)
    with pytest.raises(ValueError, match="loss_fn 'ppo' needs the per-token input 'advantages'"):
        token_loss("ppo", logp, {"logprobs": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['advantages'\] has \(2,\) values but the datum has \(3,\)"):
        token_loss("importance_sampling", logp, {"logprobs": torch.zeros(3), "advantages": torch.ones(2)})
    with pytest.raises(ValueError, match="loss_fn 'dro' needs loss_fn_config\\['beta'\\]"):
        token_loss("dro", logp, good)
    with pytest.raises(ValueError, match="loss_fn_config of 'ppo' has unknown key\\(s\\) \\['clip_eps'\\]"):
        token_loss("ppo", logp, good, {"clip_eps": 0.2})
