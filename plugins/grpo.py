"""The built-in ``grpo`` updater: Group Relative Policy Optimization (Shao et al., 2024, "DeepSeekMath"), no critic.

A sample is one prompt with the several continuations sampled for it (``generate(...,
num_return_sequences=k, do_sample=True)``, k >= 2): the group. Each continuation's advantage is its reward
relative to its group: ``A = (r - mean(group)) / (std(group) + eps)`` (``std`` unbiased, as TRL computes it;
``scale_rewards: false`` keeps ``r - mean(group)``, as Dr. GRPO does), the same for all its tokens. Per-sample
keyword arguments of ``caller.update(prompts, continuations, ...)`` are those of ``ppo_tokens`` (see
:mod:`llmrl.plugins.rollouts`): ``rewards`` (required), ``old_logprobs`` and ``ref_logprobs`` (optional).

Per token: ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A) + kl_coef * KL_t - entropy_coef * H_t``
with ``ratio = exp(logprob - old_logprob)`` and ``KL_t = exp(ref - logprob) - (ref - logprob) - 1`` (the
non-negative, unbiased estimator of DeepSeekMath; the reference is the model with its LoRA adapters disabled, or
``ref_logprobs``). ``clip_eps_high`` sets the upper clip apart (DAPO's "clip higher": ``clip(ratio, 1 - clip_eps,
1 + clip_eps_high)``). ``policy_loss`` replaces the clipped surrogate by GSPO's or CISPO's (the token losses'
maths, :mod:`llmrl.plugins.rl_math.variants`), ``kl_estimator`` picks k1, k2 or k3 (:mod:`llmrl.plugins.rl_math.kl`),
``entropy_coef`` may decay linearly over updates, and ``off_policy`` weighs the policy term by truncated or masked
importance weights from the sampler's ``behaviour_logprobs`` (:mod:`llmrl.plugins.rl_math.off_policy`; the
``off_policy_*`` statistics report the mismatch whenever they are given).

Normalisation (``loss``), with TRL's ``loss_type`` names in brackets:

- ``"sequence"`` (``grpo``): a continuation's token losses are averaged, then the group's continuations, then the
  prompts of the optimizer step;
- ``"token"``: every token of a group weighs the same (the sum over the group's tokens divided by their number),
  then the prompts are averaged;
- ``"batch_token"`` (``bnpo`` / ``dapo``): every token of the optimizer step weighs the same, whatever its group,
  micro-step or replica (the sum over the step's tokens divided by their number);
- ``"fixed_length"`` (``dr_grpo``, Dr. GRPO): a continuation's token losses are summed and divided by the constant
  ``max_new_tokens`` (give the ``generate`` call's), then averaged like ``"sequence"``; a continuation longer than
  ``max_new_tokens`` is refused.

A group is never split between replicas (it is one sample), so advantages need no communication.

Statistics per replica: ``reward`` (mean), ``reward_std`` (mean within-group standard deviation), ``policy_loss``,
``kl`` (mean per-continuation sum of ``old_logprob - ref_logprob``, the KL to the reference at collection, as
``ppo_tokens`` reports it; 0 without a KL term), ``kl_penalty`` (mean per-token estimator during training),
``approx_kl`` (old to new policy), ``clip_fraction``, ``entropy`` (when ``entropy_coef`` is set), ``tokens``,
``samples``. This module is the algorithm: the steps above and the loss of a minibatch
(:func:`grpo_token_losses`, :meth:`GRPOUpdater.minibatch_loss`); the passes over the batch are
:func:`llmrl.plugins.token_policy.train_epochs`, the maths is in :mod:`llmrl.plugins.rl_math` (:func:`group_advantages`,
:func:`clipped_surrogate`, :func:`kl_k3`, :func:`aggregate` for the normalisations), the input checks and the
first pass in :mod:`llmrl.plugins.rollouts`; all are tested against hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import (
    aggregate,
    approx_kl,
    clipped_surrogate,
    collected_kl,
    group_advantages,
    kl_penalty,
    penalised,
)
from llmrl.plugins.rl_math.off_policy import OffPolicy
from llmrl.plugins.rl_math.variants import POLICY_LOSSES, EntropySchedule, policy_loss
from llmrl.plugins.rollouts import check_inputs, first_pass
from llmrl.plugins.token_policy import (
    Minibatch,
    MinibatchTerms,
    check_off_policy,
    off_policy_weights,
    policy_forward,
    train_epochs,
)
from llmrl.plugins.updater_args import SCHEDULED_ENTROPY_COEF, describe, updater_schema


@dataclass(frozen=True)
class LossVariant:
    """A minibatch's choices beyond PPO's defaults: the policy term (:data:`POLICY_LOSSES`), the KL estimator, the
    real tokens ``[n, T]`` (``gspo`` takes its sequence ratio over them) and the importance weights ``[n, T]`` of
    the off-policy correction (None: none)."""

    policy_loss: str = "ppo"
    kl_estimator: str = "k3"
    mask: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


def grpo_token_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                      advantages: torch.Tensor, clip_eps: float, kl_coef: float, clip_eps_high: float | None = None,
                      variant: LossVariant | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token ``[n, T]``: the loss (policy term, times the importance weights when given, + ``kl_coef`` x KL
    estimator), the KL estimator (detached; zeros without a reference) and 1.0 where the ratio was clipped.
    ``advantages`` is ``[n]``; the ratio's bounds are ``[1 - clip_eps, 1 + clip_eps_high]`` whatever the policy
    term (:func:`~llmrl.plugins.rl_math.variants.policy_loss`)."""
    variant = variant or LossVariant()
    if variant.policy_loss == "ppo":
        loss, clipped = clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages[:, None], clip_eps,
                                          clip_eps_high)
    else:
        mask = torch.ones_like(logprobs, dtype=torch.bool) if variant.mask is None else variant.mask.bool()
        high = 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)
        loss, clipped = policy_loss(variant.policy_loss, logprobs, old_logprobs,
                                    advantages[:, None].expand_as(logprobs), mask, 1.0 - clip_eps, high)
    if variant.is_weights is not None:
        loss = loss * variant.is_weights
    reference = ref_logprobs if kl_coef != 0 else None
    kl = kl_penalty(logprobs, reference, like=loss, estimator=variant.kl_estimator)
    return penalised(loss, None if reference is None else kl, kl_coef), kl.detach(), clipped


class GRPOUpdater(ShufflingUpdater):
    """Args (config ``args``):
        epochs: passes over the batch per update (default 1: on-policy, the ratio is 1 at the first step).
        clip_eps: ratio clip (default 0.2).
        clip_eps_high: the upper ratio clip, when it differs from ``clip_eps`` (DAPO: 0.28; default: clip_eps).
        kl_coef: weight of the KL estimator to the reference (default 0.04, as DeepSeekMath; 0 skips the
            reference pass).
        entropy_coef: entropy bonus (default 0), or {start, end, updates}: linear from start to end over that many
            updates, then end.
        policy_loss: "ppo" (the clipped surrogate, default), "gspo" (GSPO-token: the sequence's ratio, the geometric
            mean of its token ratios, on every token) or "cispo" (the clipped ratio, without gradient, weighs
            ``-A * logprob``); all bounded to [1 - clip_eps, 1 + clip_eps_high].
        kl_estimator: "k1", "k2" or "k3" (default), the per-token KL estimator in the loss.
        off_policy: the correction from behaviour_logprobs (the sampler's) to the old log-probs: {mode: none | tis |
            mis | icepop, level: token | sequence | geometric, low, high} (default: none).
        scale_rewards: divide by the group's standard deviation (default true).
        loss: "sequence", "token", "batch_token" or "fixed_length" normalisation (default "sequence").
        max_new_tokens: the constant divisor of ``loss: fixed_length`` (required there, refused elsewhere).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"rewards": "candidate", "old_logprobs": "token", "ref_logprobs": "token",
                       "behaviour_logprobs": "token"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema("epochs", "clip_eps", "clip_eps_high", "kl_coef", "peft_adapter", "seed",
                                 "off_policy", "kl_estimator", entropy_coef=SCHEDULED_ENTROPY_COEF,
                                 policy_loss={"enum": list(POLICY_LOSSES)}, scale_rewards={"type": "boolean"},
                                 loss={"enum": ["sequence", "token", "batch_token", "fixed_length"]},
                                 max_new_tokens={"type": "integer", "minimum": 1})
    args_schema.update({"if": {"properties": {"loss": {"const": "fixed_length"}}, "required": ["loss"]},
                        "then": {"required": ["max_new_tokens"]}})  # Dr. GRPO's divisor; __init__ refuses the rest
    describe(args_schema,
             epochs="passes over the batch per update (1: on-policy, the ratio is 1 at the first step)",
             kl_coef="weight of the KL estimator to the reference (0 skips the reference pass)",
             scale_rewards="divide the rewards by their group's standard deviation",
             loss="\"sequence\", \"token\", \"batch_token\" or \"fixed_length\" normalisation",
             max_new_tokens="the constant divisor of loss: fixed_length (required there, refused elsewhere)",
             policy_loss="\"ppo\" (clipped surrogate), \"gspo\" (the sequence's ratio on every token) or \"cispo\" "
                         "(the clipped ratio, without gradient, weighs -A * logprob); bounded to [1 - clip_eps, 1 + "
                         "clip_eps_high]",
             kl_estimator="the per-token KL estimator in the loss: k1, k2 or k3 (default, DeepSeekMath's)")

    def __init__(self, epochs: int = 1, clip_eps: float = 0.2, kl_coef: float = 0.04,
                 entropy_coef: float | dict = 0.0, scale_rewards: bool = True, loss: str = "sequence",
                 peft_adapter: str | None = None, seed: int = 0, clip_eps_high: float | None = None,
                 max_new_tokens: int | None = None, policy_loss: str = "ppo", kl_estimator: str = "k3",
                 off_policy: dict | None = None):
        if (loss == "fixed_length") != (max_new_tokens is not None):
            raise ValueError("grpo's max_new_tokens is the divisor of loss: fixed_length (Dr. GRPO), and only of "
                             "it: with loss: fixed_length set max_new_tokens to the generate call's; otherwise leave "
                             "it out")
        if policy_loss != "ppo" and clip_eps > 1:
            raise ValueError(f"grpo's policy_loss {policy_loss!r} bounds the ratio to [1 - clip_eps, 1 + "
                             f"clip_eps_high]: clip_eps {clip_eps} would make the lower bound negative; give at most 1 "
                             "(1: no lower bound)")
        self.entropy_schedule = EntropySchedule.of(entropy_coef)
        self.epochs, self.clip_eps, self.kl_coef = epochs, clip_eps, kl_coef
        self.entropy_coef = self.entropy_schedule.at(0)
        self.clip_eps_high, self.max_new_tokens = clip_eps_high, max_new_tokens
        self.scale_rewards, self.loss, self.peft_adapter = scale_rewards, loss, peft_adapter
        self.policy_loss, self.kl_estimator, self.off_policy = policy_loss, kl_estimator, OffPolicy.of(off_policy)
        self.updates_done = 0
        super().__init__(seed)

    def state_dict(self) -> dict:
        """The shuffling generator and, with an entropy schedule, the updates done (where the schedule is)."""
        state = super().state_dict()
        return {**state, "updates_done": self.updates_done} if self.entropy_schedule.scheduled else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.updates_done = int(state.get("updates_done", 0))

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        rewards = check_inputs(batch, trainer, "grpo", need_reference=self.kl_coef > 0)
        check_off_policy(batch, self.off_policy, "grpo")
        self.entropy_coef = self.entropy_schedule.at(self.updates_done)
        lonely = next((i for i, c in zip(batch.indices, batch.candidates) if len(c) < 2), None)
        if lonely is not None:
            given = len(batch.candidates[batch.indices.index(lonely)])
            raise ValueError(f"prompt {lonely} has {given} continuation(s): "
                             "a GRPO group needs at least 2 continuations per prompt; generate with "
                             "num_return_sequences >= 2 (and do_sample=True)")
        prompts = first_pass(batch, trainer, rewards, self.peft_adapter, None, need_reference=self.kl_coef > 0)
        self._check_lengths(batch, prompts)
        mismatch = off_policy_weights(prompts, self.off_policy)
        reward_sum, std_sum, kl_sum = 0.0, 0.0, 0.0
        for p in prompts:
            p.tensors["advantages"] = group_advantages(p.rewards, self.scale_rewards)
            reward_sum += float(p.rewards.sum())
            std_sum += float(p.rewards.std())
            if "ref_logprobs" in p.tensors:
                kl_sum += collected_kl(p.tensors["old_logprobs"], p.tensors["ref_logprobs"], p.mask)
        continuations = sum(len(p.rewards) for p in prompts)
        tokens_of = {i: float(p.mask.sum()) for i, p in zip(batch.indices, prompts)}
        totals = train_epochs(batch, trainer, prompts, self.minibatch_loss, self.epochs, self.generator,
                              step_token_counts=tokens_of if self.loss == "batch_token" else None)
        stats = totals.token_means()
        stats.update(reward=reward_sum / max(continuations, 1), reward_std=std_sum / max(len(prompts), 1),
                     kl=kl_sum / max(continuations, 1),
                     tokens=int(sum(float(p.mask.sum()) for p in prompts)), samples=len(batch), **mismatch)
        if self.entropy_schedule.scheduled:
            stats["entropy_coef"] = self.entropy_coef
        self.updates_done += 1
        return stats

    def minibatch_loss(self, trainer: Trainer, m: Minibatch) -> MinibatchTerms:
        """One minibatch's loss, normalised as ``loss`` says, and its per-token statistics."""
        out, logp, mask, entropy = policy_forward(trainer, m.batch, self.peft_adapter,
                                                  entropy=self.entropy_coef != 0)
        device = logp.device
        advantages = torch.cat([p.tensors["advantages"] for p in m.rows]).to(device) if m.rows else \
            torch.zeros(0, device=device)
        ref = m.take("ref_logprobs", logp) if self.kl_coef > 0 else None
        old = m.take("old_logprobs", logp)
        variant = LossVariant(self.policy_loss, self.kl_estimator, mask,
                              m.take("is_weights", logp) if self.off_policy.active else None)
        per_token, kl, clipped = grpo_token_losses(logp.float(), old, ref, advantages, self.clip_eps, self.kl_coef,
                                                   self.clip_eps_high, variant)
        policy = (per_token - self.kl_coef * kl).detach()
        per_token = penalised(per_token, entropy=entropy, entropy_coef=self.entropy_coef)
        if self.loss == "batch_token":  # the step's token mean, already whole
            loss = aggregate(per_token, mask, "batch_token", out.candidate_context, out.num_contexts,
                             step_tokens=m.step_tokens, num_replicas=m.batch.num_replicas)
        else:
            loss = m.batch.mean(aggregate(per_token, mask, self.loss, out.candidate_context, out.num_contexts,
                                          max_new_tokens=self.max_new_tokens))
        approx = approx_kl(logp.detach().float() - old)
        return MinibatchTerms(loss, mask, {"policy_loss": policy, "kl_penalty": kl, "clip_fraction": clipped,
                                           "approx_kl": approx, "entropy": entropy})

    def _check_lengths(self, batch: UpdateBatch, prompts: list) -> None:
        """``fixed_length`` divides by ``max_new_tokens``: a longer continuation means the two disagree."""
        if self.loss != "fixed_length":
            return
        for index, p in zip(batch.indices, prompts):
            longest = int(p.mask.sum(1).max()) if len(p.rewards) else 0
            if longest > self.max_new_tokens:
                raise ValueError(f"prompt {index} has a continuation of {longest} tokens, more than grpo's "
                                 f"max_new_tokens {self.max_new_tokens} (loss: fixed_length divides by it): set it "
                                 "to the generate call's max_new_tokens")
