"""The off-policy correction between the sampler (``behaviour_logprobs``) and the policy at collection (the old
log-probs), :mod:`llmrl.plugins.rl_math.off_policy`: TIS, MIS and IcePop weights at token, sequence and geometric
level and the mismatch statistics against values worked out by hand; ``grpo``, ``ppo_tokens`` and ``grpo_turns``
updates with each correction equal to the documented loss written out in plain PyTorch on the bigram stand-in
(:mod:`testkit.bigram`); and :func:`~llmrl.plugins.rl_math.off_policy.correct_datums` equal to weighing each token's
``forward_backward`` loss."""

from __future__ import annotations

import math

import pytest
import torch

from llmrl.plugins.rl_math.off_policy import OffPolicy, correct_datums, importance_weights, mismatch_stats
from testkit.bigram import BigramTrainer, batch, token_logps

LN = math.log
# one row of three real tokens (weights 3, 0.4 and 1.5) and a padding token
LOG_RATIO = torch.tensor([[LN(3.0), LN(0.4), LN(1.5), 5.0]])
MASK = torch.tensor([[True, True, True, False]])


@pytest.mark.parametrize("args, weights, corrected", [
    ({"mode": "tis"}, [2.0, 0.4, 1.5, 1.0], [1, 0, 0, 0]),  # truncated at C = 2
    ({"mode": "tis", "high": 1.2}, [1.2, 0.4, 1.2, 1.0], [1, 0, 1, 0]),
    ({"mode": "mis"}, [0.0, 0.4, 1.5, 1.0], [1, 0, 0, 0]),  # masked above 2
    ({"mode": "mis", "low": 0.5, "high": 4.0}, [3.0, 0.0, 1.5, 1.0], [0, 1, 0, 0]),
    ({"mode": "icepop"}, [3.0, 0.0, 1.5, 1.0], [0, 1, 0, 0]),  # IcePop's [0.5, 5]
    ({"mode": "tis", "level": "sequence"}, [1.8, 1.8, 1.8, 1.0], [0, 0, 0, 0]),  # 3 x 0.4 x 1.5 = 1.8
    ({"mode": "mis", "level": "sequence", "high": 1.5}, [0.0, 0.0, 0.0, 1.0], [1, 1, 1, 0]),
    ({"mode": "tis", "level": "geometric", "high": 1.2}, [1.2, 1.2, 1.2, 1.0], [1, 1, 1, 0]),  # 1.8^(1/3) = 1.216
    ({"mode": "none"}, [1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0]),
])
def test_importance_weights_by_hand(args, weights, corrected):
    got, hit = importance_weights(LOG_RATIO, MASK, OffPolicy.of(args))
    torch.testing.assert_close(got, torch.tensor([weights]), atol=1e-6, rtol=0)
    assert hit.tolist() == [[float(x) for x in corrected]]


def test_geometric_level_is_the_mean_log_weight():
    got, _ = importance_weights(LOG_RATIO, MASK, OffPolicy.of({"mode": "tis", "level": "geometric"}))
    assert float(got[0, 0]) == pytest.approx(1.8 ** (1 / 3), abs=1e-6)


def test_mismatch_statistics_by_hand():
    # weights 2 and 0.5: k3 = w - 1 - log w = (1 - ln 2) and (-0.5 + ln 2), mean 0.25; chi2 = (4 + 0.25) / 2 - 1
    stats = mismatch_stats(torch.tensor([LN(2.0), LN(0.5)]), torch.tensor([1.0, 0.0]))
    assert stats == pytest.approx({"off_policy_kl": 0.25, "off_policy_chi2": 1.125, "off_policy_ratio_mean": 1.25,
                                   "off_policy_ratio_max": 2.0, "off_policy_corrected": 0.5})


@pytest.mark.parametrize("args, message", [
    ({"mode": "tis", "low": 0.5}, "truncates the weight at high only"),
    ({"mode": "mis", "low": 1.5}, "must hold the weight 1"),
    ({"mode": "none", "high": 2}, "corrects nothing"),
    ({"mode": "clip"}, "the modes are"),
    ({"mode": "tis", "C": 2}, "unknown key"),
])
def test_off_policy_arguments_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        OffPolicy.of(args)


# ---- updates against plain PyTorch -------------------------------------------------------------------------------

CONTEXTS = [[1], [2]]
CONTINUATIONS = [[[0, 1, 2, 3, 4], [3, 5]], [[5, 0, 2], [1, 2, 3, 4]]]
REWARDS = [[1.0, 0.0], [0.2, 0.9]]
OFFSETS = (-0.9, 0.9, 0.3)  # behaviour = old + offset: weights e^0.9 = 2.46, e^-0.9 = 0.41, e^-0.3 = 0.74


def behaviour(W: torch.Tensor) -> list:
    return [[(token_logps(W, c, t).detach() + torch.tensor([OFFSETS[k % 3] for k in range(len(t))])).tolist()
             for t in group] for c, group in zip(CONTEXTS, CONTINUATIONS)]


def hand_weights(tokens: list[int], args: dict) -> torch.Tensor:
    """The corrected weights of one continuation, from the offsets, in plain Python."""
    logs = [-OFFSETS[k % 3] for k in range(len(tokens))]
    level = args.get("level", "token")
    if level != "token":
        total = sum(logs) if level == "sequence" else sum(logs) / len(logs)
        logs = [total] * len(logs)
    low, high = {"tis": (None, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}[args["mode"]]
    low, high = args.get("low", low), args.get("high", high)
    out = []
    for w in (math.exp(x) for x in logs):
        out.append(min(w, high) if args["mode"] == "tis" else (w if low <= w <= high else 0.0))
    return torch.tensor(out)


def plain_grpo_gradient(trainer: BigramTrainer, args: dict) -> torch.Tensor:
    """grpo's documented loss (sequence normalisation, no KL) with the policy term weighed by the corrected
    weights; the old log-probs are the policy's at collection (the first pass), so the ratio is 1 in value."""
    W = trainer.W.detach().clone().requires_grad_(True)
    per_prompt = []
    for c, group, rewards in zip(CONTEXTS, CONTINUATIONS, REWARDS):
        r = torch.tensor(rewards)
        advantages = (r - r.mean()) / (r.std() + 1e-4)
        per_continuation = []
        for tokens, a in zip(group, advantages):
            logp = token_logps(W, c, tokens)
            ratio = torch.exp(logp - token_logps(trainer.W, c, tokens).detach())
            policy = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
            per_continuation.append((policy * hand_weights(tokens, args)).mean())
        per_prompt.append(torch.stack(per_continuation).mean())
    torch.stack(per_prompt).mean().backward()
    return W.grad


CORRECTIONS = [{"mode": "tis"}, {"mode": "mis"}, {"mode": "icepop"}, {"mode": "tis", "level": "sequence", "high": 3.0},
               {"mode": "mis", "level": "geometric", "low": 0.9, "high": 1.1}]


@pytest.mark.parametrize("args", CORRECTIONS)
def test_grpo_update_with_a_correction_equals_the_plain_loss(args):
    from llmrl.plugins.grpo import GRPOUpdater

    trainer = BigramTrainer()
    stats = GRPOUpdater(kl_coef=0.0, off_policy=args).update(
        batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, behaviour_logprobs=behaviour(trainer.W)), trainer)
    torch.testing.assert_close(trainer.grads[0][0], plain_grpo_gradient(trainer, args), atol=1e-6, rtol=0)
    weights = torch.cat([hand_weights(t, args) for group in CONTINUATIONS for t in group])
    logs = torch.tensor([-OFFSETS[k % 3] for group in CONTINUATIONS for t in group for k in range(len(t))])
    assert stats["off_policy_ratio_max"] == pytest.approx(math.exp(0.9), abs=1e-5)
    assert stats["off_policy_kl"] == pytest.approx(float((logs.exp() - 1 - logs).mean()), abs=1e-5)
    assert stats["off_policy_chi2"] == pytest.approx(float((logs.exp() ** 2).mean() - 1), abs=1e-5)
    raw = torch.cat([hand_weights(t, {**args, "mode": "tis", "high": math.inf}) for group in CONTINUATIONS
                     for t in group])
    assert stats["off_policy_corrected"] == pytest.approx(float((weights != raw).float().mean()), abs=1e-6)


def test_tis_reports_the_share_of_truncated_tokens():
    from llmrl.plugins.grpo import GRPOUpdater

    trainer = BigramTrainer()
    stats = GRPOUpdater(kl_coef=0.0, off_policy={"mode": "tis"}).update(
        batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, behaviour_logprobs=behaviour(trainer.W)), trainer)
    tokens = [k for group in CONTINUATIONS for t in group for k in range(len(t))]
    assert stats["off_policy_corrected"] == pytest.approx(sum(k % 3 == 0 for k in tokens) / len(tokens), abs=1e-6)


def test_behaviour_logprobs_alone_report_the_mismatch_and_train_as_before():
    from llmrl.plugins.grpo import GRPOUpdater

    plain, reported = BigramTrainer(), BigramTrainer()
    GRPOUpdater().update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS), plain)
    stats = GRPOUpdater().update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS,
                                       behaviour_logprobs=behaviour(reported.W)), reported)
    assert torch.equal(plain.grads[0][0], reported.grads[0][0])
    assert stats["off_policy_ratio_max"] == pytest.approx(math.exp(0.9), abs=1e-5)
    assert stats["off_policy_corrected"] == 0.0


def test_a_correction_without_behaviour_logprobs_is_refused():
    from llmrl.plugins.grpo import GRPOUpdater

    trainer = BigramTrainer()
    with pytest.raises(ValueError, match="pass behaviour_logprobs"):
        GRPOUpdater(off_policy={"mode": "tis"}).update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS), trainer)
    assert not trainer.grads


@pytest.mark.parametrize("args", [{"mode": "mis"}, {"mode": "tis", "level": "sequence", "high": 3.0}])
def test_ppo_tokens_update_with_a_correction_equals_the_plain_loss(args):
    """No critic, no KL, gamma = lam = 1, no whitening: every token's advantage is its continuation's reward."""
    from llmrl.plugins.ppo_tokens import PPOTokensUpdater

    trainer = BigramTrainer()
    updater = PPOTokensUpdater(epochs=1, kl_coef=0.0, value_head=None, whiten=False, lam=1.0, off_policy=args)
    updater.update(batch(CONTEXTS, CONTINUATIONS, rewards=REWARDS, behaviour_logprobs=behaviour(trainer.W)), trainer)
    W = trainer.W.detach().clone().requires_grad_(True)
    per_prompt = []
    for c, group, rewards in zip(CONTEXTS, CONTINUATIONS, REWARDS):
        per_continuation = []
        for tokens, reward in zip(group, rewards):
            logp = token_logps(W, c, tokens)
            ratio = torch.exp(logp - logp.detach())
            policy = -torch.minimum(ratio * reward, torch.clamp(ratio, 0.8, 1.2) * reward)
            per_continuation.append((policy * hand_weights(tokens, args)).mean())
        per_prompt.append(torch.stack(per_continuation).mean())
    torch.stack(per_prompt).mean().backward()
    torch.testing.assert_close(trainer.grads[0][0], W.grad, atol=1e-6, rtol=0)


def test_grpo_turns_weighs_the_model_tokens_only():
    """Two episodes from one start; environment tokens (model_mask 0) are neither trained nor weighed."""
    from llmrl.plugins.ppo_turns import GRPOTurnsUpdater

    episodes = [[[0, 1, 2, 3, 4], [3, 3, 5, 1]]]
    masks = [[[1, 1, 0, 1, 1], [1, 0, 0, 1]]]
    returns = [[[1.0, 0.0], [0.0, 0.0]]]
    trainer = BigramTrainer()
    offsets = [[[-0.9, 0.9, -7.0, 0.3, -0.9], [0.3, -7.0, -7.0, -0.9]]]  # -7: environment tokens, never read
    given = [[(token_logps(trainer.W, [1], e).detach() + torch.tensor(o)).tolist()
              for e, o in zip(episodes[0], offsets[0])]]
    GRPOTurnsUpdater(off_policy={"mode": "tis"}).update(
        batch([[1]], episodes, model_mask=masks, turn_rewards=returns, behaviour_logprobs=given), trainer)
    W = trainer.W.detach().clone().requires_grad_(True)
    totals = torch.tensor([1.0, 0.0])
    advantages = (totals - totals.mean()) / (totals.std() + 1e-4)
    per_episode = []
    for tokens, mask, o, a in zip(episodes[0], masks[0], offsets[0], advantages):
        logp = token_logps(W, [1], tokens)
        ratio = torch.exp(logp - logp.detach())
        policy = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        weights = torch.tensor([min(math.exp(-x), 2.0) for x in o])
        own = torch.tensor(mask, dtype=torch.bool)
        per_episode.append((policy * weights)[own].mean())
    torch.stack(per_episode).mean().backward()
    torch.testing.assert_close(trainer.grads[0][0], W.grad, atol=1e-6, rtol=0)


# ---- forward_backward's token losses -----------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo", "gspo", "dro"])
def test_corrected_datums_weigh_each_tokens_policy_term(loss):
    from llmrl.engine.token_losses import token_loss

    logp = torch.tensor([-1.0, -0.5, -2.0, -0.3], requires_grad=True)
    sampler = torch.tensor([-1.1, -0.4, -2.2, 0.0])  # the policy's at collection (the ratio's start)
    behaviour_ = sampler + torch.tensor([-0.9, 0.9, 0.3, 0.0])
    advantages = [0.5, -1.0, 2.0, 0.0]  # the last position is a prompt token: advantage 0, unread
    inputs = {"logprobs": sampler.tolist(), "advantages": advantages, "behaviour_logprobs": behaviour_.tolist(),
              "sequence_ratio_mask": [1.0, 1.0, 1.0, 0.0]}
    data, stats = correct_datums([{"model_input": [0], "loss_fn_inputs": inputs}], {"mode": "tis"})
    corrected = data[0]["loss_fn_inputs"]
    assert "behaviour_logprobs" not in corrected
    weights = torch.tensor([2.0, math.exp(-0.9), math.exp(-0.3), 1.0])  # e^0.9 truncated at 2
    config = {"beta": 0.1} if loss == "dro" else None
    tensors = {k: torch.tensor(v) for k, v in corrected.items()}
    got = token_loss(loss, logp, tensors, config)
    plain = {k: torch.tensor(v) for k, v in inputs.items() if k != "behaviour_logprobs"}
    plain["advantages"] = plain["advantages"] * weights
    torch.testing.assert_close(got, token_loss(loss, logp, plain, config))
    if loss in ("importance_sampling", "ppo", "cispo"):  # linear in the advantage: the weight scales each token
        unweighted = token_loss(loss, logp, {k: torch.tensor(v) for k, v in inputs.items()}, config)
        torch.testing.assert_close(got, unweighted * weights)
    assert stats["off_policy_corrected"] == pytest.approx(1 / 3)
    assert stats["off_policy_ratio_max"] == pytest.approx(math.exp(0.9), abs=1e-5)
