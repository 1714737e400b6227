"""The built-in ``ppo_tokens`` updater: PPO over generated tokens with a KL penalty to a reference policy, as in
trlX and RL4LMs (Ziegler et al., 2019, "Fine-Tuning Language Models from Human Preferences").

Each generated token is an action; the state is the prompt and the tokens before it. Per-sample keyword arguments
of ``caller.update(prompts, continuations, ...)`` (one sample = one prompt and the continuations generated for it,
given as the ``tokens`` of ``generate``'s samples; see :mod:`llmrl.plugins.rollouts` for the shapes):

    rewards: per prompt, one entry per continuation: a number (the reward model's or the task's score, counted on
        the continuation's last token) or a list with one number per generated token (dense rewards, as trlX's
        reward functions may return; added to the per-token rewards as given).
    old_logprobs: (optional) per continuation, the log-prob of each token under the policy that generated it
        (``generate``'s ``logprobs``); without it, one gradient-free pass before training computes it.
    ref_logprobs: (optional) per continuation, each token's log-prob under the reference policy, e.g. another LLM
        of the run scored with ``caller.score(..., per_token=True, llm="reference")``; without it, the reference
        is this model with its LoRA adapters disabled (the starting model).

What one update does, on every replica (its share of the prompts):

1. A gradient-free pass computes the value head's V(s_t) per token, the reference log-probs and, when not given,
   the old log-probs.
2. Per-token rewards: ``r_t = -beta * (old_logprob_t - ref_logprob_t)`` plus the task reward of token t: the
   continuation's reward on its last token, or its dense reward of token t. Task rewards are first clipped to
   ``[-reward_clip, reward_clip]``, then (``reward_scale``) divided by a standard deviation of the continuations'
   total task rewards (trlX's ``cliprange_reward`` and ``scale_reward``, :mod:`llmrl.plugins.task_rewards`):
   ``running``, over every update so far (this one's included; kept in checkpoints), or ``ref``, ``reward_ref_std``
   or else the first update's. ``beta`` is ``kl_coef``, adapted after each update when ``kl_target`` is set (the
   proportional controller of Ziegler et al.:
   ``beta *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) * samples / kl_horizon``, KL being the batch's mean
   per-continuation sum of ``old_logprob - ref_logprob``).
3. GAE over each continuation's tokens (``gamma``, ``lam``; the value after the last token is 0); returns are
   advantages + values. Advantages are whitened (mean 0, standard deviation 1) over every token of the whole
   batch, all replicas together (``whiten``).
4. ``epochs`` passes in shuffled minibatches of ``training.micro_batch_size`` prompts per replica. Per token:
   the clipped policy loss ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)`` with ``ratio =
   exp(logprob - old_logprob)``, ``value_coef`` x the clipped value loss ``0.5 * max((V - R)^2, (V_clipped -
   R)^2)`` (``V_clipped`` within ``value_clip`` of the first pass's value; null: unclipped) and ``-entropy_coef``
   x the entropy (``entropy_coef`` may decay linearly over updates). With ``off_policy`` and the sampler's
   ``behaviour_logprobs``, the policy term is weighed by truncated or masked importance weights
   (:mod:`llmrl.plugins.rl_math.off_policy`); ``kl_estimator`` picks the KL estimator of step 2's penalty (k1, as
   written there, by default). Normalisation: each continuation's token losses are averaged (every continuation
   weighs the same whatever its length), then a prompt's continuations, then prompts (:meth:`UpdateBatch.mean`).

Statistics returned per replica: ``reward`` (mean of the continuations' total task rewards as given, before clipping
and scaling), ``reward_divisor`` (with ``reward_scale``: what task rewards were divided by), ``kl`` (mean per-
continuation KL to the reference at collection), ``kl_coef`` (the beta used), ``policy_loss``, ``value_loss``,
``value_error`` (mean squared error of the first pass's values against the returns), ``entropy``, ``approx_kl`` (old
to new policy), ``clip_fraction`` (tokens whose ratio was clipped), ``tokens``, ``samples``, and, with
``behaviour_logprobs``, the ``off_policy_*`` mismatch statistics.

This module is the algorithm: the order of the steps above and the loss of a minibatch
(:meth:`PPOTokensUpdater.minibatch_loss`); the passes over the batch are
:func:`llmrl.plugins.token_policy.train_epochs`. The maths is in :mod:`llmrl.plugins.rl_math`
(:func:`kl_penalised_rewards`, :func:`token_gae`, :func:`token_ppo_losses`, :class:`AdaptiveKL`, whitening) and
:mod:`llmrl.plugins.task_rewards` (reward clipping and scaling), the input checks
and the first pass in :mod:`llmrl.plugins.rollouts`; both are tested against hand-computed values.
"""

from __future__ import annotations

import torch

from llmrl.plugins.contracts import ShufflingUpdater, Trainer, UpdateBatch
from llmrl.plugins.rl_math import (
    AdaptiveKL,
    aggregate,
    collected_kl,
    kl_penalised_rewards,
    penalised,
    refuse_whitening_one,
    token_gae,
    token_ppo_losses,
    whiten_batch,
)
from llmrl.plugins.rl_math.off_policy import OffPolicy
from llmrl.plugins.rl_math.variants import EntropySchedule
from llmrl.plugins.rollouts import check_inputs, first_pass
from llmrl.plugins.task_rewards import SCALES, RewardScaler
from llmrl.plugins.token_policy import (
    Minibatch,
    MinibatchTerms,
    check_off_policy,
    off_policy_weights,
    policy_forward,
    train_epochs,
)
from llmrl.plugins.updater_args import SCHEDULED_ENTROPY_COEF, describe, updater_schema


class PPOTokensUpdater(ShufflingUpdater):
    """Args (config ``args``):
        epochs: passes over the batch per update (default 4).
        clip_eps: policy ratio clip (default 0.2).
        value_clip: value clip around the first pass's values (default 0.2; null disables).
        value_coef / entropy_coef: loss weights (defaults 0.5 and 0.0); entropy_coef may be {start, end, updates}:
            linear from start to end over that many updates, then end.
        kl_estimator: the per-token KL estimator in the reward: "k1" (default: logprob - ref), "k2" or "k3".
        off_policy: the correction from behaviour_logprobs (the sampler's) to the old log-probs: {mode: none | tis |
            mis | icepop, level: token | sequence | geometric, low, high} (default: none).
        kl_coef: initial KL penalty coefficient beta (default 0.05; 0 disables the penalty and the reference pass).
        kl_target: adapt beta towards this mean KL per continuation (default null: beta stays fixed).
        kl_horizon: the controller's horizon in continuations (default 10000).
        gamma / lam: GAE discount and lambda over tokens (defaults 1.0 and 0.95).
        whiten: whiten advantages over the whole batch (default true).
        reward_clip: clip every task reward (a score, or each dense reward) to [-reward_clip, reward_clip] (trlX's
            cliprange_reward; default null: no clip).
        reward_scale: null (default), "running" or "ref": divide task rewards by the running standard deviation
            of the continuations' total rewards, or by reward_ref_std (default: the first update's) (trlX's
            scale_reward).
        reward_ref_std: the standard deviation "ref" divides by (trlX's ref_std; default null: the first update's).
        value_head: the token-level head giving V(s_t) (default "value"; null: no critic, advantages are the
            discounted per-token returns).
        peft_adapter: the LoRA adapter to train (default: the active one).
        seed: seed of the minibatch shuffling.
    """

    per_sample_args = {"rewards": "candidate_or_token", "old_logprobs": "token", "ref_logprobs": "token",
                       "behaviour_logprobs": "token"}
    whole_args: tuple = ()  # nothing else: any other keyword argument is refused
    args_schema = updater_schema("epochs", "clip_eps", "value_clip", "value_coef", "kl_coef",
                                 "value_head", "peft_adapter", "seed", "off_policy", "kl_estimator",
                                 entropy_coef=SCHEDULED_ENTROPY_COEF,
                                 kl_target={"type": ["number", "null"], "exclusiveMinimum": 0},
                                 kl_horizon={"type": "number", "exclusiveMinimum": 0},
                                 gamma={"type": "number", "minimum": 0, "maximum": 1},
                                 lam={"type": "number", "minimum": 0, "maximum": 1},
                                 whiten={"type": "boolean"},
                                 reward_clip={"type": ["number", "null"], "exclusiveMinimum": 0},
                                 reward_scale={"enum": list(SCALES)},
                                 reward_ref_std={"type": ["number", "null"], "exclusiveMinimum": 0})
    describe(args_schema,
             kl_coef="initial KL penalty coefficient beta (0 disables the penalty and the reference pass)",
             kl_target="adapt beta towards this mean KL per continuation (null: beta stays fixed)",
             kl_horizon="the KL controller's horizon in continuations",
             gamma="GAE discount over tokens",
             lam="GAE lambda over tokens",
             whiten="whiten advantages over the whole batch",
             value_clip="value clip around the first pass's values (null disables)",
             value_head="the token-level head giving V(s_t) (null: no critic, advantages are the discounted "
                        "per-token returns)",
             reward_clip="clip every task reward to [-reward_clip, reward_clip] (null: no clip)",
             reward_scale="null, \"running\" or \"ref\": divide task rewards by the running standard deviation of "
                          "the continuations' total rewards, or by reward_ref_std",
             reward_ref_std="the standard deviation \"ref\" divides by (null: the first update's)",
             kl_estimator="the per-token KL estimator in the reward: k1 (default: logprob - ref), k2 ((logprob - "
                          "ref)^2 / 2) or k3 (exp(ref - logprob) - (ref - logprob) - 1)")

    def __init__(self, epochs: int = 4, clip_eps: float = 0.2, value_clip: float | None = 0.2,
                 value_coef: float = 0.5, entropy_coef: float | dict = 0.0, kl_coef: float = 0.05,
                 kl_target: float | None = None, kl_horizon: float = 10000.0, gamma: float = 1.0, lam: float = 0.95,
                 whiten: bool = True, value_head: str | None = "value", peft_adapter: str | None = None,
                 seed: int = 0, reward_clip: float | None = None, reward_scale: str | None = None,
                 reward_ref_std: float | None = None, kl_estimator: str = "k1", off_policy: dict | None = None):
        if reward_ref_std is not None and reward_scale != "ref":
            raise ValueError(f"reward_ref_std is the standard deviation reward_scale 'ref' divides by; with "
                             f"reward_scale {reward_scale!r} nothing reads it: set reward_scale: ref, or drop it")
        if kl_target is not None and kl_coef == 0:
            raise ValueError("kl_target adapts kl_coef by multiplying it, so from kl_coef 0 it would stay 0 (and no "
                             "reference pass would run): give kl_coef > 0 as the starting value, or drop kl_target")
        self.epochs, self.clip_eps, self.value_clip = epochs, clip_eps, value_clip
        self.entropy_schedule = EntropySchedule.of(entropy_coef)
        self.value_coef, self.entropy_coef = value_coef, self.entropy_schedule.at(0)
        self.kl_estimator, self.off_policy, self.updates_done = kl_estimator, OffPolicy.of(off_policy), 0
        self.kl = AdaptiveKL(kl_coef, kl_target, kl_horizon)
        self.gamma, self.lam, self.whiten = gamma, lam, whiten
        self.value_head, self.peft_adapter = value_head, peft_adapter
        self.task_rewards = RewardScaler(reward_clip, reward_scale, reward_ref_std)
        super().__init__(seed)

    def state_dict(self) -> dict:
        """Saved in checkpoints: the shuffling generator, the adapted KL coefficient and the reward scaler's
        statistics."""
        state = {**super().state_dict(), "kl_coef": self.kl.value, "task_rewards": self.task_rewards.state_dict()}
        return {**state, "updates_done": self.updates_done} if self.entropy_schedule.scheduled else state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.kl.target is not None:  # adapted: the run's value; fixed: the config's (a resume may change it)
            self.kl.value = float(state["kl_coef"])
        if "task_rewards" in state:  # checkpoints written before reward scaling have none
            self.task_rewards.load_state_dict(state["task_rewards"])
        self.updates_done = int(state.get("updates_done", 0))

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        rewards = check_inputs(batch, trainer, "ppo_tokens", need_reference=self.kl.value > 0, dense=True)
        check_off_policy(batch, self.off_policy, "ppo_tokens")
        self.entropy_coef = self.entropy_schedule.at(self.updates_done)
        beta = self.kl.value
        self.prepare(batch, trainer)
        prompts = first_pass(batch, trainer, rewards, self.peft_adapter, self.value_head, need_reference=beta > 0,
                             reward_rows=True, policy_pass=self.first_policy_pass())
        if self.whiten:  # before anything that keeps state (the reward scaler's running moments)
            refuse_whitening_one(float(trainer.sum_across_replicas(sum(float(p.mask.sum()) for p in prompts))), "token")
        divisor = self._shape_task_rewards(prompts, trainer)
        collected = {"kl": 0.0, "reward": 0.0, "value_error": 0.0, "tokens": 0.0, "continuations": 0.0}
        for p in prompts:  # per-token rewards, GAE
            t = p.tensors
            policy = t.get("kl_logprobs", t["old_logprobs"])  # (nlpo: the unmasked policy's, not the ratio's)
            ref = t.get("ref_logprobs", policy)
            rewards = kl_penalised_rewards(t["task_rewards"], policy, ref, p.mask, beta, self.kl_estimator)
            values = t["values"] if "values" in t else torch.zeros_like(rewards)
            t["advantages"], t["returns"] = token_gae(rewards, values, p.mask, self.gamma, self.lam)
            collected["kl"] += collected_kl(policy, ref, p.mask)
            collected["reward"] += float(p.rewards.sum())
            collected["value_error"] += float((((values - t["returns"]) ** 2) * p.mask).sum())
            collected["tokens"] += float(p.mask.sum())
            collected["continuations"] += len(p.rewards)
        if self.whiten:
            whitened = whiten_batch([p.tensors["advantages"] for p in prompts], [p.mask for p in prompts],
                                    trainer.sum_across_replicas)
            for p, advantages in zip(prompts, whitened):
                p.tensors["advantages"] = advantages
        totals = trainer.sum_across_replicas([collected["kl"], collected["continuations"]])
        mean_kl = float(totals[0] / max(float(totals[1]), 1.0))
        mismatch = off_policy_weights(prompts, self.off_policy)

        passes = train_epochs(batch, trainer, prompts, self.minibatch_loss, self.epochs, self.generator)
        n = max(collected["continuations"], 1.0)
        stats = passes.token_means()
        stats.update(reward=collected["reward"] / n, kl=collected["kl"] / n, kl_coef=beta,
                     value_error=collected["value_error"] / max(collected["tokens"], 1.0),
                     tokens=int(collected["tokens"]), samples=len(batch), batch_kl=mean_kl, **mismatch)
        if self.entropy_schedule.scheduled:
            stats["entropy_coef"] = self.entropy_coef
        self.updates_done += 1
        if self.task_rewards.scale is not None:
            stats["reward_divisor"] = divisor
        self.kl.update(mean_kl, int(totals[1]))
        return stats

    def minibatch_loss(self, trainer: Trainer, m: Minibatch) -> MinibatchTerms:
        """One minibatch's loss (each continuation's token mean, then each prompt's, then the step's) and its
        per-token statistics."""
        heads = [self.value_head] if self.value_head else []
        out, logp, mask, entropy = self.policy_pass(trainer, m.batch, heads)
        values = out.tokens_by_candidate(out.heads[self.value_head].float())[0] if self.value_head else None
        terms = token_ppo_losses(logp.float(), m.take("old_logprobs", logp), m.take("advantages", logp), values,
                                 m.take("values", logp) if self.value_head else None, m.take("returns", logp),
                                 self.clip_eps, self.value_clip)
        policy = terms.policy * m.take("is_weights", logp) if self.off_policy.active else terms.policy
        per_token = penalised(policy + self.value_coef * terms.value,
                              entropy=entropy if self.entropy_coef != 0 else None, entropy_coef=self.entropy_coef)
        per_prompt = aggregate(per_token, mask, "sequence", out.candidate_context, out.num_contexts)
        return MinibatchTerms(m.batch.mean(per_prompt), mask, {
            "policy_loss": policy, "value_loss": terms.value, "approx_kl": terms.approx_kl,
            "clip_fraction": terms.clipped, "entropy": entropy})

    def prepare(self, batch: UpdateBatch, trainer: Trainer) -> None:
        """Before the first pass (``nlpo`` makes sure its masking policy exists); nothing here."""

    def first_policy_pass(self):
        """The first pass's policy pass (:func:`~llmrl.plugins.rollouts.first_pass`): None, the plain one."""
        return None

    def policy_pass(self, trainer: Trainer, mb: UpdateBatch, heads: list) -> tuple:
        """One training pass of the policy: its outputs, ``[n, T]`` log-probs, mask and entropies (reported even
        without an entropy bonus)."""
        return policy_forward(trainer, mb, self.peft_adapter, heads, entropy=True)

    def _shape_task_rewards(self, prompts: list, trainer: Trainer) -> float:
        """Clip each prompt's ``task_rewards`` rows in place and, with ``reward_scale``, divide them by the
        scaler's divisor, computed from the whole batch's total rewards (one collective, on every replica alike:
        whether it runs depends on the config only). Returns the divisor."""
        for p in prompts:
            p.tensors["task_rewards"] = self.task_rewards.clipped(p.tensors["task_rewards"])
        if self.task_rewards.scale is None:
            return 1.0
        stats = trainer.sum_across_replicas(self.task_rewards.batch_stats([p.tensors["task_rewards"]
                                                                           for p in prompts]))
        divisor = self.task_rewards.divisor(stats)
        for p in prompts:
            p.tensors["task_rewards"] = p.tensors["task_rewards"] / divisor
        return divisor
