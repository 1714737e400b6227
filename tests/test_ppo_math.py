"""The PPO maths of the built-in updater (plugins/ppo.py and the parts it takes from plugins/rl_math.py) against
values computed by hand."""

import math

import pytest
import torch

from llmrl.plugins.ppo import ppo_terms
from llmrl.plugins.rl_math import categorical_kl, gae


def test_gae_by_hand():
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72), one environment, no episode end:
    #   delta2 = 2 + 0.9 * 2.0 - 1.5 = 2.3                      A2 = 2.3
    #   delta1 = 0 + 0.9 * 1.5 - 1.0 = 0.35                     A1 = 0.35 + 0.72 * 2.3 = 2.006
    #   delta0 = 1 + 0.9 * 1.0 - 0.5 = 1.4                      A0 = 1.4 + 0.72 * 2.006 = 2.84432
    # second environment: the episode ends at t=1, so nothing flows back across it:
    #   A2 = 2.3,  A1 = 0 - 1.0 = -1.0,  A0 = 1.4 + 0.72 * -1.0 = 0.68
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    values = torch.tensor([[0.5, 0.5], [1.0, 1.0], [1.5, 1.5]])
    dones = torch.tensor([[0, 0], [0, 1], [0, 0]])
    advantages, returns = gae(rewards, values, dones, torch.tensor([2.0, 2.0]), gamma=0.9, lam=0.8)
    expected = torch.tensor([[2.84432, 0.68], [2.006, -1.0], [2.3, 2.3]])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(returns, expected + values, rtol=0, atol=1e-5)


def test_gae_with_lambda_one_is_the_discounted_return_minus_the_value():
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.1], [0.2], [0.3]])
    advantages, returns = gae(rewards, values, torch.zeros(3, 1), torch.tensor([4.0]), gamma=0.5, lam=1.0)
    # return0 = 1 + 0.5 * 2 + 0.25 * 3 + 0.125 * 4 = 3.25; return1 = 2 + 1.5 + 1 = 4.5; return2 = 3 + 2 = 5
    torch.testing.assert_close(returns[:, 0], torch.tensor([3.25, 4.5, 5.0]))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([3.15, 4.3, 4.7]))


def policy(p=(0.25, 0.75)):
    """Candidate scores whose softmax is ``p``, with a padded third column."""
    return torch.tensor([[math.log(p[0]), math.log(p[1]), 0.0]]), torch.tensor([[True, True, False]])


def terms_for(ratio, advantage, clip_eps=0.2, **value):
    logits, mask = policy()
    logits = logits.requires_grad_()
    old = torch.tensor([math.log(0.75 / ratio)])  # so that p(action 1) / p_old = ratio
    terms = ppo_terms(logits, mask, torch.tensor([1]), old, torch.tensor([advantage]),
                      value.get("values"), value.get("returns"), value.get("old_values"), clip_eps,
                      value.get("value_clip"))
    return terms, logits


@pytest.mark.parametrize("ratio, advantage, loss, clipped, has_gradient", [
    (1.5, 2.0, -2.4, 1.0, False),   # -min(1.5 * 2, 1.2 * 2): clipped, so no gradient
    (1.5, -2.0, 3.0, 1.0, True),    # -min(-3.0, -2.4) = 3.0: the pessimistic term is the unclipped one
    (1.1, 1.0, -1.1, 0.0, True),    # inside the trust region
    (0.5, -1.0, 0.8, 1.0, False),   # -min(-0.5, 0.8 * -1) = 0.8, clipped from below
    (0.5, 1.0, -0.5, 1.0, True),    # -min(0.5, 0.8) = -0.5: unclipped term kept (and still gets gradient)
])
def test_policy_loss_clipping_by_hand(ratio, advantage, loss, clipped, has_gradient):
    terms, logits = terms_for(ratio, advantage)
    assert terms.policy_loss.item() == pytest.approx(loss, abs=1e-5)
    assert terms.clipped.item() == clipped
    assert terms.approx_kl.item() == pytest.approx((ratio - 1) - math.log(ratio), abs=1e-6)
    terms.policy_loss.sum().backward()
    assert (logits.grad.abs().sum().item() > 1e-6) == has_gradient


def test_policy_gradient_matches_the_score_function_by_hand():
    # Unclipped: loss = -ratio * A, d loss / d logit_j = -ratio * A * (1[j = a] - p_j).
    terms, logits = terms_for(1.1, 1.0)
    terms.policy_loss.sum().backward()
    expected = torch.tensor([[-1.1 * (0 - 0.25), -1.1 * (1 - 0.75), 0.0]])
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-5)


def test_entropy_ignores_padding():
    terms, _ = terms_for(1.0, 0.0)
    assert terms.entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    assert torch.isfinite(terms.entropy).all()


@pytest.mark.parametrize("values, returns, old_values, value_clip, expected", [
    (1.0, 2.0, 0.5, 0.2, 0.845),  # clipped prediction 0.7: max((1 - 2)^2, (0.7 - 2)^2) / 2 = 1.69 / 2
    (1.0, 0.0, 0.5, 0.2, 0.5),    # max((1 - 0)^2, (0.7 - 0)^2) / 2 = 1 / 2
    (0.6, 2.0, 0.5, 0.2, 0.98),   # within the clip: (0.6 - 2)^2 / 2
    (1.0, 2.0, 0.5, None, 0.5),   # no clipping: (1 - 2)^2 / 2
])
def test_value_loss_clipping_by_hand(values, returns, old_values, value_clip, expected):
    terms, _ = terms_for(1.0, 0.0, values=torch.tensor([values]), returns=torch.tensor([returns]),
                         old_values=torch.tensor([old_values]), value_clip=value_clip)
    assert terms.value_loss.item() == pytest.approx(expected, abs=1e-6)


def test_no_value_head_gives_no_value_loss():
    terms, _ = terms_for(1.0, 1.0)
    assert terms.value_loss.item() == 0.0


def test_kl_to_base_by_hand():
    logits, mask = policy((0.25, 0.75))
    base, _ = policy((0.5, 0.5))
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert categorical_kl(logits, base, mask).item() == pytest.approx(expected, abs=1e-6)
    assert categorical_kl(logits, logits, mask).item() == pytest.approx(0.0, abs=1e-7)


def test_an_action_that_is_not_one_of_its_contexts_candidates_is_refused():
    """An index past a context's candidates would read a padded slot of a longer context's row (log-prob -inf: the
    sample's policy term silently 0); a fractional one would be cut. Integers of numpy and torch are indices too."""
    import numpy as np

    from llmrl.plugins.ppo import check_actions

    candidates = [[" a", " b"], [" a", " b", " c"], [" a"]]
    check_actions([1, np.int64(2), torch.tensor(0)], candidates, [0, 1, 2])
    check_actions([1.0, 2.0, 0.0], candidates, [0, 1, 2])  # a float tensor's tolist()
    for actions, where, shown in (([2, 0, 0], 4, "2"), ([0, 1.7, 0], 5, "1.7"), ([0, 0, -1], 6, "-1")):
        with pytest.raises(ValueError, match=rf"'actions'\[{where}\] is {shown}, but context {where} offers"):
            check_actions(actions, candidates, [4, 5, 6])


def test_settings_that_would_do_nothing_silently_are_refused():
    """ppo's KL term with no adapter to disable compares the policy with itself (0); kl_target adapts kl_coef by
    multiplying it (from 0 it stays 0); reward_ref_std is read by reward_scale 'ref' only."""
    from types import SimpleNamespace

    from llmrl.plugins.ppo import PPOUpdater
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    batch = SimpleNamespace(candidates=[[" a", " b"]], kwargs={})
    with pytest.raises(ValueError, match=r"KL term \(kl_coef > 0\).*has none"):
        PPOUpdater(kl_coef=0.1).update(batch, SimpleNamespace(has_adapters=False))
    with pytest.raises(ValueError, match="kl_target adapts kl_coef"):
        PPOTokensUpdater(kl_coef=0.0, kl_target=6.0)
    with pytest.raises(ValueError, match="reward_ref_std is the standard deviation reward_scale 'ref'"):
        PPOTokensUpdater(reward_ref_std=2.0)
    PPOTokensUpdater(reward_scale="ref", reward_ref_std=2.0, kl_coef=0.1, kl_target=6.0)  # meaningful together
