"""The loss variants of the token-level policy updaters against values worked out by hand and, on the bigram
stand-in for the trainer (:mod:`testkit.bigram`), against the documented loss written out in plain PyTorch: the KL
estimators k1, k2 and k3 (``kl_estimator``, in ``grpo``'s loss and in ``ppo_tokens``' reward), ``grpo``'s
``policy_loss`` gspo and cispo (the token losses' maths on rows), the entropy schedule (``entropy_coef: {start, end,
updates}``), and DAPO's client-side helpers (the overlong penalty, dynamic sampling's group filter)."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.plugins.rl_math.kl import kl_estimate
from llmrl.plugins.rl_math.variants import EntropySchedule, policy_loss
from testkit.bigram import BigramTrainer, batch, token_logps

E = math.e


@pytest.mark.parametrize("estimator, expected", [
    ("k1", [1.0, -1.0, 0.0]),  # d = logprob - ref
    ("k2", [0.5, 0.5, 0.0]),  # d^2 / 2
    ("k3", [1 / E, E - 2, 0.0]),  # exp(-d) - 1 + d
])
def test_kl_estimators_by_hand(estimator, expected):
    got = kl_estimate(torch.tensor([0.0, -1.0, -2.0]), torch.tensor([-1.0, 0.0, -2.0]), estimator)
    torch.testing.assert_close(got, torch.tensor(expected))


def test_an_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="the estimators are"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_policy_loss_terms_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.5, -0.5]])  # ratios e^0.5 = 1.65, e^-0.5 = 0.61, 1; padding last
    mask = torch.tensor([[True, True, False]])
    a = torch.full((1, 3), 2.0)
    cispo, clipped = policy_loss("cispo", logp, old, a, mask, 0.8, 1.2)
    # -clip(ratio) * A * logp, the clipped ratio without gradient: 1.2 and 0.8
    torch.testing.assert_close(cispo, torch.tensor([[-1.2 * 2 * -1.0, -0.8 * 2 * -2.0, -1.0 * 2 * -0.5]]))
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]
    gspo, clipped = policy_loss("gspo", logp, old, a, mask, 0.8, 1.2)
    # the sequence ratio over the two real tokens: exp((0.5 - 0.5) / 2) = 1, inside the bounds: -A on every token
    torch.testing.assert_close(gspo, torch.full((1, 3), -2.0))
    assert clipped.tolist() == [[0.0, 0.0, 0.0]]
    gspo.sum().backward()  # each token carries its own log-prob's gradient: d(-A * exp(logp - sg(logp))) = -A
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -2.0))


def test_entropy_schedule_by_hand():
    schedule = EntropySchedule.of({"start": 0.1, "end": 0.0, "updates": 4})
    assert [schedule.at(n) for n in range(6)] == pytest.approx([0.1, 0.075, 0.05, 0.025, 0.0, 0.0])
    assert EntropySchedule.of(0.01).at(100) == 0.01 and not EntropySchedule.of(0.01).scheduled


def test_overlong_penalty_by_hand():
    from llmrl import overlong_penalty

    assert overlong_penalty([10, 16, 18, 20, 25], max_length=20, cache_length=4) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(17, 20, 4) == -0.25
    with pytest.raises(ValueError, match="0 < cache_length <= max_length"):
        overlong_penalty(3, 20, 0)


def test_dynamic_sampling_keeps_the_groups_whose_rewards_differ():
    from llmrl import keep_varied_groups

    kept = keep_varied_groups([[1, 0, 1], [1, 1, 1], [0.5, 0.2], [0.0, 0.0], torch.tensor([0.3, 0.3001])])
    assert kept.kept == [0, 2, 4] and kept.dropped == 2
    assert keep_varied_groups([[0.3, 0.3001]], tolerance=1e-3).dropped == 1


# ---- updates against plain PyTorch -------------------------------------------------------------------------------

CONTEXTS = [[1], [2]]
CONTINUATIONS = [[[0, 1, 2, 3, 4], [3, 5]], [[5, 0, 2], [1, 2, 3, 4]]]
REWARDS = [[1.0, 0.0], [0.2, 0.9]]
KL_COEF = 0.1


def old_logprobs(W: torch.Tensor) -> list:
    """0.25 away from the current log-probs, alternately up and down (ratios 0.78 and 1.28)."""
    return [[(token_logps(W, c, t).detach() + 0.25 * torch.tensor([(-1.0) ** k for k in range(len(t))])).tolist()
             for t in group] for c, group in zip(CONTEXTS, CONTINUATIONS)]


def entropies(W: torch.Tensor, context: list[int], tokens: list[int]) -> torch.Tensor:
    table = torch.log_softmax(W, -1)
    return torch.stack([-(table[p].exp() * table[p]).sum() for p in [context[-1], *tokens[:-1]]])


def plain_grpo_gradient(trainer: BigramTrainer, old: list, policy: str = "ppo", estimator: str = "k3",
                        entropy_coef: float = 0.0) -> torch.Tensor:
    """grpo's documented loss (sequence normalisation), token by token."""
    W = trainer.W.detach().clone().requires_grad_(True)
    per_prompt = []
    for c, group, rewards, olds in zip(CONTEXTS, CONTINUATIONS, REWARDS, old):
        r = torch.tensor(rewards)
        advantages = (r - r.mean()) / (r.std() + 1e-4)
        per_continuation = []
        for tokens, a, o in zip(group, advantages, olds):
            logp, o = token_logps(W, c, tokens), torch.tensor(o)
            if policy == "ppo":
                ratio = torch.exp(logp - o)
                term = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            elif policy == "gspo":  # the sequence's ratio (geometric mean), each token's own gradient
                ratio = torch.exp((logp.detach() - o).mean()) * torch.exp(logp - logp.detach())
                term = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            else:  # cispo
                term = -torch.clamp(torch.exp(logp - o), 0.8, 1.2).detach() * a * logp
            d = logp - token_logps(trainer.W0, c, tokens)
            kl = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[estimator]
            per_token = term + KL_COEF * kl - entropy_coef * entropies(W, c, tokens)
            per_continuation.append(per_token.mean())
        per_prompt.append(torch.stack(per_continuation).mean())
    torch.stack(per_prompt).mean().backward()
    return W.grad


@pytest.mark.parametrize("args", [{"kl_estimator": "k1"}, {"kl_estimator": "k2"}, {"kl_estimator": "k3"},
                                  {"policy_loss": "gspo"}, {"policy_loss": "cispo"},
                                  {"policy_loss": "gspo", "kl_estimator": "k2"}])
def test_grpo_update_with_each_variant_equals_the_plain_loss(args):
    from llmrl.plugins.grpo import GRPOUpdater

    trainer = BigramTrainer()
    old = old_logprobs(trainer.W)
    GRPOUpdater(kl_coef=KL_COEF, **args).update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, old_logprobs=old),
                                                 trainer)
    expected = plain_grpo_gradient(trainer, old, args.get("policy_loss", "ppo"), args.get("kl_estimator", "k3"))
    torch.testing.assert_close(trainer.grads[0][0], expected, atol=1e-6, rtol=0)


def test_the_variants_differ_on_this_batch():
    trainer = BigramTrainer()
    old = old_logprobs(trainer.W)
    grads = [plain_grpo_gradient(trainer, old, p, k) for p, k in
             [("ppo", "k3"), ("gspo", "k3"), ("cispo", "k3"), ("ppo", "k1"), ("ppo", "k2")]]
    for i in range(len(grads)):
        for j in range(i):
            assert float((grads[i] - grads[j]).abs().max()) > 1e-4


def test_grpo_entropy_schedule_decays_over_updates():
    from llmrl.plugins.grpo import GRPOUpdater

    updater = GRPOUpdater(kl_coef=KL_COEF, entropy_coef={"start": 0.2, "end": 0.0, "updates": 2})
    coefficients = []
    for _ in range(3):
        trainer = BigramTrainer()
        old = old_logprobs(trainer.W)
        stats = updater.update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, old_logprobs=old), trainer)
        coefficients.append(stats["entropy_coef"])
        expected = plain_grpo_gradient(trainer, old, entropy_coef=stats["entropy_coef"])
        torch.testing.assert_close(trainer.grads[0][0], expected, atol=1e-6, rtol=0)
    assert coefficients == pytest.approx([0.2, 0.1, 0.0])
    resumed = GRPOUpdater(entropy_coef={"start": 0.2, "end": 0.0, "updates": 2})
    resumed.load_state_dict(updater.state_dict())
    assert resumed.updates_done == 3


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_ppo_tokens_kl_estimator_in_the_reward_equals_the_plain_loss(estimator):
    """No critic, gamma = lam = 1, no whitening: each token's advantage is the sum of the rewards from it on, the
    task reward on the last token and ``-kl_coef * KL_t`` on every token (KL_t the estimator's at collection)."""
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    trainer = BigramTrainer()
    old = old_logprobs(trainer.W)
    updater = PPOTokensUpdater(epochs=1, kl_coef=KL_COEF, value_head=None, whiten=False, lam=1.0,
                               kl_estimator=estimator)
    stats = updater.update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, old_logprobs=old), trainer)
    W = trainer.W.detach().clone().requires_grad_(True)
    per_prompt = []
    for c, group, rewards, olds in zip(CONTEXTS, CONTINUATIONS, REWARDS, old):
        per_continuation = []
        for tokens, reward, o in zip(group, rewards, olds):
            o = torch.tensor(o)
            d = o - token_logps(trainer.W0, c, tokens)
            kl = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[estimator]
            r = -KL_COEF * kl
            r[-1] += reward
            advantages = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0])
            logp = token_logps(W, c, tokens)
            ratio = torch.exp(logp - o)
            policy = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
            per_continuation.append(policy.mean())
        per_prompt.append(torch.stack(per_continuation).mean())
    torch.stack(per_prompt).mean().backward()
    torch.testing.assert_close(trainer.grads[0][0], W.grad, atol=1e-6, rtol=0)
    assert "entropy_coef" not in stats  # no schedule: nothing new reported


def test_grpo_turns_kl_estimator_in_the_loss():
    """Every advantage 0 (the episodes return alike): the loss is kl_coef x the estimator over the model's tokens."""
    from llmrl.plugins.ppo_turns import GRPOTurnsUpdater

    episodes, masks = [[[0, 1, 2, 3], [3, 5, 1]]], [[[1, 1, 0, 1], [1, 0, 1]]]
    trainer = BigramTrainer()
    GRPOTurnsUpdater(kl_coef=KL_COEF, kl_estimator="k2").update(
        batch([[1]], episodes, model_mask=masks, turn_rewards=[[[1.0, 0.0], [0.5, 0.5]]]), trainer)
    W = trainer.W.detach().clone().requires_grad_(True)
    per_episode = []
    for tokens, mask in zip(episodes[0], masks[0]):
        d = token_logps(W, [1], tokens) - token_logps(trainer.W0, [1], tokens)
        per_episode.append((KL_COEF * d * d / 2)[torch.tensor(mask, dtype=torch.bool)].mean())
    torch.stack(per_episode).mean().backward()
    torch.testing.assert_close(trainer.grads[0][0], W.grad, atol=1e-6, rtol=0)


def test_gspo_and_cispo_refuse_a_negative_lower_bound():
    from llmrl.plugins.grpo import GRPOUpdater

    with pytest.raises(ValueError, match="lower bound negative"):
        GRPOUpdater(policy_loss="cispo", clip_eps=1.5)


def test_the_argument_schemas_list_the_maths_names_and_check_the_shapes():
    from llmrl.plugins.checks import args_problem
    from llmrl.plugins.grpo import GRPOUpdater
    from llmrl.plugins.nlpo import NLPOUpdater
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater
    from llmrl.plugins.ppo_turns import GRPOTurnsUpdater, PPOTurnsUpdater
    from llmrl.plugins.rl_math.kl import KL_ESTIMATORS
    from llmrl.plugins.rl_math.off_policy import LEVELS, MODES
    from llmrl.plugins.updater_args import SHARED_ARGS

    shape = SHARED_ARGS["off_policy"]["properties"]
    assert shape["mode"]["enum"] == list(MODES) and shape["level"]["enum"] == list(LEVELS)
    assert SHARED_ARGS["kl_estimator"]["enum"] == list(KL_ESTIMATORS)
    good = {"off_policy": {"mode": "mis", "level": "geometric", "low": 0.5, "high": 2.0}, "kl_estimator": "k2",
            "entropy_coef": {"start": 0.01, "end": 0.0, "updates": 100}}
    for cls in (GRPOUpdater, PPOTokensUpdater, NLPOUpdater, PPOTurnsUpdater, GRPOTurnsUpdater):
        assert args_problem(cls, good, cls.__name__) is None
        assert "C" in args_problem(cls, {"off_policy": {"mode": "tis", "C": 2}}, cls.__name__)
        assert args_problem(cls, {"entropy_coef": {"start": 0.1}}, cls.__name__) is not None
    assert args_problem(GRPOUpdater, {"policy_loss": "gspo"}, "grpo") is None
    assert args_problem(GRPOUpdater, {"policy_loss": "dro"}, "grpo") is not None
