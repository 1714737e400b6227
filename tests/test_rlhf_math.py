"""The maths of the RLHF updaters against values computed by hand: KL-penalised per-token rewards, GAE over tokens,
the clipped token-level PPO losses, the adaptive KL controller, GRPO's group advantages and loss, the
Bradley-Terry loss; and the checks on the per-prompt, per-continuation inputs (errors name the argument)."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.plugins.grpo import grpo_token_losses
from llmrl.plugins.reward_model import bradley_terry_loss
from llmrl.plugins.rl_math import (
    AdaptiveKL,
    group_advantages,
    kl_penalised_rewards,
    mean_and_std,
    per_prompt_mean,
    sequence_mean,
    token_gae,
    token_ppo_losses,
    whiten_stats,
)
from llmrl.plugins.rollouts import rewards_of, token_rows_of


def close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32),
                               atol=atol, rtol=0)


def test_kl_penalised_rewards_put_the_score_on_the_last_real_token():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rewards = kl_penalised_rewards(torch.tensor([1.0, -2.0]), logp, ref, mask, 0.1)
    # row 0: -0.1 x (0.5, 0, -1) = (-0.05, 0, 0.1), score 1 on token 2; row 1: (-0.05, 0) and score -2 on token 1
    close(rewards, [[-0.05, 0.0, 1.1], [-0.05, -2.0, 0.0]])


def test_dense_rewards_are_added_token_by_token_and_train_another_advantage_than_their_sum():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    dense = torch.tensor([[0.5, 0.0, 0.5], [-1.0, -1.0, 7.0]])  # the 7 is after row 1's end: dropped
    rewards = kl_penalised_rewards(dense, logp, ref, mask, 0.1)
    close(rewards, [[0.45, 0.0, 0.6], [-1.05, -1.0, 0.0]])
    # The same total on the last token is another reward sequence: with gamma < 1 its advantages differ.
    scalar = kl_penalised_rewards(torch.tensor([1.0, -2.0]), logp, ref, mask, 0.1)
    values = torch.zeros(2, 3)
    dense_adv, _ = token_gae(rewards, values, mask, gamma=0.5, lam=1.0)
    scalar_adv, _ = token_gae(scalar, values, mask, gamma=0.5, lam=1.0)
    # row 0, dense: A2 = 0.6, A1 = 0 + 0.5 x 0.6 = 0.3, A0 = 0.45 + 0.5 x 0.3 = 0.6;
    # scalar: rewards (-0.05, 0, 1.1): A2 = 1.1, A1 = 0.55, A0 = -0.05 + 0.275 = 0.225
    close(dense_adv[0], [0.6, 0.3, 0.6])
    close(scalar_adv[0], [0.225, 0.55, 1.1])


def test_token_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 1.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = token_gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=0.5)
    # deltas: t2 = 1 - 0.4 = 0.6; t1 = 0.4 - 0.2 = 0.2; t0 = 0.2 - 0.5 = -0.3
    # A2 = 0.6, A1 = 0.2 + 0.5 x 0.6 = 0.5, A0 = -0.3 + 0.5 x 0.5 = -0.05
    close(adv, [[-0.05, 0.5, 0.6]])
    close(ret, [[0.45, 0.7, 1.0]])
    adv, ret = token_gae(rewards[1:], values[1:], mask[1:], gamma=0.9, lam=1.0)
    # the row ends at t1 (the 9 and the 7 after it are padding): A1 = 2 - 1 = 1, A0 = 0.9 x 1 - 1 + 0.9 x 1 = 0.8
    close(adv, [[0.8, 1.0, 0.0]])
    close(ret, [[1.8, 2.0, 0.0]])


def test_token_ppo_losses_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    values, old_values = torch.tensor([[1.0, 0.0, 0.5]]), torch.full((1, 3), 0.5)
    returns = torch.tensor([[2.0, 0.0, 0.5]])
    t = token_ppo_losses(logp, old, adv, values, old_values, returns, clip_eps=0.2, value_clip=0.2)
    # ratio 1.5, A 1: min(1.5, 1.2) -> -1.2; ratio 0.5, A -1: min(-0.5, -0.8) -> 0.8; ratio 1.1, A 2: -2.2
    close(t.policy, [[-1.2, 0.8, -2.2]])
    close(t.clipped, [[1.0, 1.0, 0.0]])
    # values clipped to 0.7, 0.3, 0.5: 0.5 x max(1, 1.69), 0.5 x max(0, 0.09), 0
    close(t.value, [[0.845, 0.045, 0.0]])
    close(t.approx_kl[0, 0], 0.5 - math.log(1.5))
    unclipped = token_ppo_losses(logp, old, adv, values, old_values, returns, clip_eps=0.2, value_clip=None)
    close(unclipped.value, [[0.5, 0.0, 0.0]])


def test_adaptive_kl_controller_by_hand():
    kl = AdaptiveKL(0.1, target=6.0, horizon=100)
    assert kl.update(9.0, samples=10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error 0.5 clipped to 0.2
    assert kl.update(5.4, samples=50) == pytest.approx(0.102 * (1 - 0.1 * 0.5))  # error -0.1
    fixed = AdaptiveKL(0.05)
    assert fixed.update(100.0, samples=1000) == 0.05


def test_group_advantages_by_hand():
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # unbiased, around the mean 3
    close(group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0])), [x / (std + 1e-4) for x in (-2, -1, 0, 3)], atol=1e-5)
    close(group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), scale=False), [-2.0, -1.0, 0.0, 3.0])
    close(group_advantages(torch.tensor([0.5, 0.5])), [0.0, 0.0])
    with pytest.raises(ValueError, match="num_return_sequences >= 2"):
        group_advantages(torch.tensor([1.0]))


def test_grpo_token_losses_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.9]]))
    ref = logp + torch.tensor([[-math.log(1.5), 0.3]])
    loss, kl, clipped = grpo_token_losses(logp, torch.zeros(1, 2), ref, torch.tensor([2.0]), 0.2, 0.1)
    k3 = [1 / 1.5 + math.log(1.5) - 1, math.exp(0.3) - 0.3 - 1]  # exp(d) - d - 1, d = ref - logp
    close(kl, [k3])
    # ratio 1.5 clipped to 1.2 (x A 2 = 2.4); ratio 0.9 inside the clip (x 2 = 1.8)
    close(loss, [[-2.4 + 0.1 * k3[0], -1.8 + 0.1 * k3[1]]])
    close(clipped, [[1.0, 0.0]])
    no_kl, _, _ = grpo_token_losses(logp, torch.zeros(1, 2), None, torch.tensor([2.0]), 0.2, 0.1)
    close(no_kl, [[-2.4, -1.8]])


def test_bradley_terry_loss_by_hand():
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.5]))
    close(loss, [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.5))])


def test_whitening_statistics_and_normalisations():
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    mean, std = mean_and_std(whiten_stats(values, mask))
    assert mean == pytest.approx(2.5) and std == pytest.approx(math.sqrt(5 / 3))
    halves = whiten_stats(values[:1], mask[:1]) + whiten_stats(values[1:], mask[1:])  # as summed over replicas
    assert mean_and_std(halves) == pytest.approx((mean, std))
    close(sequence_mean(values, mask), [1.5, 3.5])
    close(per_prompt_mean(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]), 2), [2.0, 10.0])


def test_inputs_are_read_per_prompt_and_continuation_and_refused_by_name():
    close(rewards_of([0.5, [1.0, -1.0], torch.tensor([2.0, 3.0, 4.0])], [1, 2, 3], [0, 1, 2]),
          [0.5, 1.0, -1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"rewards\[7\] must hold one number per continuation of prompt 7 \(2\)"):
        rewards_of([[1.0]], [2], [7])
    lengths = torch.tensor([2, 3, 1])
    rows = token_rows_of([[-1.0, -2.0], [torch.tensor([-3.0, -4.0, -5.0]), [-6.0]]], [1, 2], lengths, [4, 5],
                         "old_logprobs")
    close(rows, [[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0], [-6.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"old_logprobs\[5\]\[1\] has 2 values but continuation 1 of prompt 5 has 1"):
        token_rows_of([[-1.0, -2.0], [[-3.0, -4.0, -5.0], [-6.0, -7.0]]], [1, 2], lengths, [4, 5], "old_logprobs")
    with pytest.raises(ValueError, match=r"ref_logprobs\[4\] holds 1 sequences but prompt 4 has 2"):
        token_rows_of([[[-1.0, -2.0]]], [2], lengths[:2], [4], "ref_logprobs")
    with pytest.raises(ValueError, match="non-finite"):
        rewards_of([float("nan")], [1], [0])


def test_dense_rewards_are_read_per_token_and_refused_by_name_with_both_lengths():
    from llmrl.plugins.rollouts import reward_rows_of

    # prompt 4: one continuation given a dense list; prompt 5: a number and a dense tensor
    value = [[[0.1, 0.2]], [1.5, torch.tensor([0.3, 0.0, -0.3])]]
    close(rewards_of(value, [1, 2], [4, 5], dense=True), [0.3, 1.5, 0.0])  # dense ones count by their sum
    lengths = torch.tensor([2, 4, 3])
    close(reward_rows_of(value, [1, 2], lengths, [4, 5]),
          [[0.1, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 1.5], [0.3, 0.0, -0.3, 0.0]])
    with pytest.raises(ValueError, match=r"rewards\[5\]\[1\] holds 3 dense rewards but continuation 1 of prompt 5 "
                                         r"has 4 generated tokens"):
        reward_rows_of(value, [1, 2], torch.tensor([2, 4, 4]), [4, 5])
    with pytest.raises(ValueError, match=r"rewards\[4\] must hold one entry per continuation of prompt 4 \(1\), got "
                                         "2 numbers.*one number per generated token"):
        rewards_of([[0.1, 0.2]], [1], [4], dense=True)  # a bare list is one entry per continuation, not dense
    with pytest.raises(ValueError, match=r"rewards\[0\] must hold one number per continuation"):
        rewards_of([[[0.1, 0.2]]], [1], [0])  # grpo: no dense rewards


def test_ppo_tokens_refuses_a_value_head_that_is_not_token_level():
    from llmrl.plugins.contracts import ForwardOutputs, UpdateBatch
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    class OneContextTrainer:  # what the engine returns for one prompt with one 2-token continuation
        micro_batch_size, has_adapters = 4, True

        def forward(self, contexts, candidates, heads=(), **kwargs):
            return ForwardOutputs("causal", 1, torch.tensor([-3.0]), torch.tensor([2]), torch.tensor([0]),
                                  heads={"value": torch.tensor([0.5])}, head_levels={"value": "context"},
                                  token_logprobs=torch.tensor([-1.0, -2.0]), token_candidate=torch.tensor([0, 0]))

        def adapters_disabled(self):
            import contextlib

            return contextlib.nullcontext()

    batch = UpdateBatch(["a prompt"], [[[5, 6]]], {"rewards": [1.0]}, [0], 1, 0, 1, [1])
    with pytest.raises(ValueError, match="'value' is a context-level head.*token_value"):
        PPOTokensUpdater().update(batch, OneContextTrainer())


def test_given_old_logprobs_without_a_reference_or_value_head_run_no_pass():
    """grpo without a KL term, given old log-probs: the first pass makes no model call, the rows are the given
    log-probs, masked by the counts from the tokenisation; a value head or a reference pass still runs it."""
    from llmrl.plugins.contracts import UpdateBatch
    from llmrl.plugins.rollouts import first_pass

    class CountingTrainer:
        micro_batch_size, has_adapters = 8, True

        def __init__(self):
            self.forwards = 0

        def forward(self, *args, **kwargs):
            self.forwards += 1
            raise AssertionError("no model call was expected")

        def scored_token_counts(self, contexts, candidates, add_eos=False):
            return torch.tensor([len(x) for c in candidates for x in c])

        def adapters_disabled(self):
            import contextlib

            return contextlib.nullcontext()

    old = [[[-0.5, -1.0], [-2.0]], [[-0.1, -0.2, -0.3], [-0.4]]]
    batch = UpdateBatch(["a", "b"], [[[5, 6], [7]], [[8, 9, 10], [11]]], {"rewards": [[1.0, 0.0], [0.5, 0.2]],
                                                                         "old_logprobs": old}, [0, 1], 1, 0, 1, [2])
    trainer = CountingTrainer()
    rewards = [torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.2])]
    prompts = first_pass(batch, trainer, rewards, None, None, need_reference=False)
    assert trainer.forwards == 0
    for p, given in zip(prompts, old):
        for k, values in enumerate(given):
            assert p.mask[k].sum() == len(values)
            assert p.tensors["old_logprobs"][k, :len(values)].tolist() == pytest.approx(values)
    for value_head, reference in (("value", False), (None, True)):
        with pytest.raises(AssertionError, match="no model call"):
            first_pass(batch, trainer, rewards, None, value_head, need_reference=reference)


def test_a_value_head_pass_with_given_old_logprobs_computes_no_logprobs():
    """ppo_tokens with the client's old log-probs: the first pass runs only for the value head, asks the engine
    for no log-prob (``logprobs=False``), and the rows hold the given log-probs; without them it asks for them."""
    from llmrl.plugins.contracts import ForwardOutputs, UpdateBatch
    from llmrl.plugins.rollouts import first_pass

    class RecordingTrainer:  # one prompt, one 2-token continuation, a token-level value head
        micro_batch_size, has_adapters = 4, True

        def __init__(self):
            self.asked = []

        def forward(self, contexts, candidates, heads=(), **kwargs):
            self.asked.append(kwargs.get("logprobs", True))
            lp = torch.tensor([-1.0, -2.0]) if self.asked[-1] else torch.full((2,), float("nan"))
            return ForwardOutputs("causal", 1, lp.sum()[None], torch.tensor([2]), torch.tensor([0]),
                                  heads={"value": torch.tensor([0.5, 0.25])}, head_levels={"value": "token"},
                                  token_logprobs=lp, token_candidate=torch.tensor([0, 0]))

    rewards = [torch.tensor([1.0])]
    for given, asked, want in ((True, False, [-0.3, -0.4]), (False, True, [-1.0, -2.0])):
        kwargs = {"rewards": [1.0], **({"old_logprobs": [[[-0.3, -0.4]]]} if given else {})}
        trainer = RecordingTrainer()
        (prompt,) = first_pass(UpdateBatch(["a prompt"], [[[5, 6]]], kwargs, [0], 1, 0, 1, [1]), trainer, rewards,
                               None, "value", need_reference=False)
        assert trainer.asked == [asked]
        assert prompt.tensors["old_logprobs"][0].tolist() == pytest.approx(want)
        assert prompt.tensors["values"][0].tolist() == pytest.approx([0.5, 0.25])
