"""The RL maths of the built-in updaters, as pure functions of tensors, each tested against hand-computed values.

What is here: advantage estimation (:func:`gae` over ``[T, N]`` environment steps, :func:`token_gae` along each
row of generated tokens, :func:`group_advantages` within a GRPO group; across a multi-turn episode's turns,
:func:`turn_spans`, :func:`turn_gae`, :func:`turn_returns` and :func:`group_episode_advantages`), the PPO losses
(:func:`clipped_surrogate` on epsilons, over :func:`clipped_ratio_loss` on ratio bounds; :func:`value_loss`), the
KL estimators (:func:`approx_kl` between the old and new policy, :func:`kl_k3` to a reference per token,
:func:`categorical_kl` between two distributions over the same candidates), the KL-penalised per-token rewards (a
reward per continuation, or dense per-token rewards) and their adaptive coefficient (:func:`kl_penalised_rewards`,
:class:`AdaptiveKL`; the task rewards' clipping and scaling are in :mod:`llmrl.plugins.task_rewards`), whitening
across replicas (:func:`whiten_batch`, over :func:`whiten_stats`, :func:`mean_and_std` and :func:`whiten`), the
per-token terms of a token-level PPO or GRPO minibatch (:func:`token_ppo_losses`, :func:`kl_penalty`,
:func:`penalised`; :func:`collected_kl`, the KL statistic of a collection) and the means that weigh tokens,
continuations and prompts (:func:`sequence_mean`, :func:`per_prompt_mean`, :func:`per_prompt_token_mean`, and
:func:`aggregate`, the updaters' loss aggregations ``sequence``, ``token``, ``batch_token`` and ``fixed_length``), and
the per-token losses of client-owned training steps (:func:`token_loss`: ``cross_entropy``, ``importance_sampling``,
``ppo``, ``cispo``, ``dro``, ``gspo`` and any other registered with :func:`register_token_loss`: the keys of
:data:`TOKEN_LOSSES`, with Tinker's names, inputs and definitions; a new one is one decorated function, see
:func:`register_token_loss`). The engine serves the token losses and the client's episode helpers use the turn
returns, so those live in :mod:`llmrl.engine.token_losses` and :mod:`llmrl.engine.episode_returns` (the engine never
imports a built-in plugin) and are re-exported here, with the same names. Submodules hold the maths of one
family each, re-exported here: :mod:`~llmrl.plugins.rl_math.preference` (``dpo``'s :func:`preference_loss`: DPO,
robust DPO, IPO), :mod:`~llmrl.plugins.rl_math.ilql` (``ilql``'s :func:`ilql_losses`, steered logits and
:func:`polyak_update`), :mod:`~llmrl.plugins.rl_math.masking` (``nlpo``'s :func:`top_p_mask` and
:func:`masked_logprobs`), :mod:`~llmrl.plugins.rl_math.kl` (the KL estimators k1, k2, k3: :func:`kl_k3`,
:func:`kl_estimate`, :func:`kl_penalty`), :mod:`~llmrl.plugins.rl_math.off_policy` (truncated and masked importance
sampling from the sampler's log-probs, the mismatch statistics), :mod:`~llmrl.plugins.rl_math.variants` (GSPO's and
CISPO's policy terms on rows, the entropy schedule) and :mod:`~llmrl.plugins.rl_math.dapo` (DAPO's overlong penalty
and dynamic sampling filter, for scripts).

What is not: no function reads a batch, calls the model or talks to other replicas (the updaters in
:mod:`llmrl.plugins.ppo`, :mod:`llmrl.plugins.ppo_tokens`, :mod:`llmrl.plugins.grpo` and
:mod:`llmrl.plugins.ppo_turns` do; whitening statistics are summed across replicas by a function the caller
passes), and nothing checks its inputs' shapes beyond what torch does
(:mod:`llmrl.plugins.rollouts` checks the per-sample arguments first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmrl.engine.graph import keep_in_graph
from llmrl.engine.token_losses import clipped_ratio_loss

# ---- advantages --------------------------------------------------------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_values: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over ``T`` steps of ``N`` environments (a client-side helper).

    Args:
        rewards, values, dones: ``[T, N]``; ``dones[t]`` is 1 when the episode ended at step t (the value after
            it is not used).
        last_values: ``[N]`` value of the observation after the last step.

    Returns:
        ``(advantages, returns)``, both ``[T, N]``; returns = advantages + values.
    """
    steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros_like(last_values, dtype=torch.float32)
    for t in reversed(range(steps)):
        next_values = last_values if t == steps - 1 else values[t + 1]
        alive = 1.0 - dones[t].float()
        delta = rewards[t] + gamma * next_values * alive - values[t]
        running = delta + gamma * lam * alive * running
        advantages[t] = running
    return advantages, advantages + values


def token_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE along each row's tokens (the value after the last real token is 0). Returns ``(advantages, returns)``,
    both ``[n, T]``, zero after each row's end; returns = advantages + values."""
    mask_f = mask.float()
    values = values * mask_f
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    width = rewards.shape[1]
    for t in reversed(range(width)):
        alive = mask_f[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        next_values = values[:, t + 1] * alive if t + 1 < width else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        running = (delta + gamma * lam * alive * running) * mask_f[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask_f


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """``[k]`` the advantages of one group's ``k`` rewards: centred on the group mean, divided by the group's
    unbiased standard deviation + ``eps`` when ``scale``."""
    if rewards.numel() < 2:
        raise ValueError("a GRPO group needs at least 2 continuations per prompt; generate with "
                         "num_return_sequences >= 2 (and do_sample=True)")
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if scale else centred


def turn_spans(model_mask: torch.Tensor) -> list[tuple[int, int]]:
    """The turns of one trajectory: the maximal runs of True in its ``[T]`` model-token mask, as ``(start, end)``
    (end excluded). Consecutive turns are separated by at least one environment token."""
    spans, start = [], None
    for t, own in enumerate(model_mask.tolist()):
        if own and start is None:
            start = t
        elif not own and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, len(model_mask)))
    return spans


def turn_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float, last_value: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE across the ``K`` turns of one episode, a turn being one step: ``delta_k = r_k + gamma * V_(k+1) - V_k``,
    ``A_k = delta_k + gamma * lam * A_(k+1)``. The value after the last turn is 0 (the episode ended), or
    ``last_value`` for an episode cut short (truncated: bootstrapped from the critic's value of the state it was cut
    in). ``(advantages, returns)``, both ``[K]``; returns = advantages + values."""
    k = rewards.shape[0]
    ended = torch.zeros((k, 1))
    if last_value is None:
        ended[-1] = 1.0
    after = torch.tensor([0.0 if last_value is None else float(last_value)])
    advantages, returns = gae(rewards.float()[:, None], values.float()[:, None], ended, after, gamma, lam)
    return advantages[:, 0], returns[:, 0]


# ---- PPO losses --------------------------------------------------------------------------------------------------


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
                      clip_eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, clipped)``: PPO's clipped policy loss ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)``
    and, detached, 1.0 where the ratio left ``[1 - eps, 1 + eps_high]``. ``eps_high`` is ``clip_eps`` unless
    given (DAPO's "clip higher" raises it, e.g. 0.28). ``advantages`` broadcasts against ``ratio``. The surrogate
    itself is :func:`clipped_ratio_loss` (on ratio bounds, as the token losses ``ppo`` and ``gspo`` use it)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    loss = clipped_ratio_loss(ratio, advantages, 1.0 - clip_eps, 1.0 + high)
    return loss, ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + high)).float().detach()


def value_loss(values: torch.Tensor | None, returns: torch.Tensor | None, old_values: torch.Tensor | None,
               value_clip: float | None, like: torch.Tensor) -> torch.Tensor:
    """``0.5 * (V - R)^2``, or with ``value_clip`` and ``old_values`` the clipped form ``0.5 * max((V - R)^2,
    (V_clipped - R)^2)`` (``V_clipped`` within ``value_clip`` of ``old_values``); zeros shaped ``like`` without
    values or returns (no critic)."""
    if values is None or returns is None:
        return torch.zeros_like(like)
    if value_clip is None or old_values is None:
        return 0.5 * (values - returns) ** 2
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


@dataclass
class TokenLosses:
    """Per-token terms of a token-level PPO minibatch, ``[n, T]`` (meaningful where the mask is True)."""

    policy: torch.Tensor
    value: torch.Tensor  # zeros without a critic
    approx_kl: torch.Tensor  # (ratio - 1) - log ratio, detached
    clipped: torch.Tensor  # 1.0 where the ratio left [1 - clip_eps, 1 + clip_eps], detached


def token_ppo_losses(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     values: torch.Tensor | None, old_values: torch.Tensor | None, returns: torch.Tensor | None,
                     clip_eps: float, value_clip: float | None) -> TokenLosses:
    """The clipped policy loss (:func:`clipped_surrogate`, ``ratio = exp(logprobs - old_logprobs)``) and the
    (clipped) value loss (:func:`value_loss`) of every token, with the old-to-new KL estimate and the clipped
    tokens."""
    log_ratio = logprobs - old_logprobs
    policy, clipped = clipped_surrogate(torch.exp(log_ratio), advantages, clip_eps)
    return TokenLosses(policy, value_loss(values, returns, old_values, value_clip, like=policy), approx_kl(log_ratio),
                       clipped)


def penalised(loss: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
              entropy: torch.Tensor | None = None, entropy_coef: float = 0.0) -> torch.Tensor:
    """Per token, ``loss + kl_coef * kl - entropy_coef * entropy``, each term only when given (None: not in the
    loss)."""
    if kl is not None:
        loss = loss + kl_coef * kl
    if entropy is not None:
        loss = loss - entropy_coef * entropy
    return loss


# ---- KL ----------------------------------------------------------------------------------------------------------


def approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Detached ``(ratio - 1) - log ratio``: the non-negative estimator of KL(old || new) from ``log new - log old``
    (reported, never trained on)."""
    return ((torch.exp(log_ratio) - 1.0) - log_ratio).detach()


def collected_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """The summed per-token log-ratio ``logprob - ref_logprob`` over the real tokens of ``[n, T]`` rows: the KL of
    the collecting policy to the reference, summed over the continuations (the updaters report its mean)."""
    return float(((logprobs - ref_logprobs) * mask).sum())


def categorical_kl(logits: torch.Tensor, base_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` KL(policy || base) of two categorical distributions over the same masked candidates ``[n, K]``."""
    logp = torch.log_softmax(logits.masked_fill(~mask, float("-inf")), -1)
    base = torch.log_softmax(base_logits.masked_fill(~mask, float("-inf")), -1)
    return (logp.exp() * (logp - base).masked_fill(~mask, 0.0)).sum(-1)


def kl_penalised_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float, estimator: str = "k1") -> torch.Tensor:
    """``[n, T]`` per-token rewards: ``-kl_coef * KL_t`` on every real token (``KL_t`` the ``estimator``'s,
    :func:`kl_estimate`; ``k1``: ``logprob - ref_logprob``), plus the task's rewards: with ``scores`` of shape
    ``[n]``, ``scores[i]`` on row ``i``'s last real token; with ``[n, T]`` (dense rewards, one per token, as trlX's
    reward functions may return), ``scores[i, t]`` on token ``t``. Zeros after each row's end."""
    mask_f = mask.float()
    kl = (logprobs - ref_logprobs) if estimator == "k1" else kl_estimate(logprobs, ref_logprobs, estimator)
    rewards = -kl_coef * kl * mask_f
    if scores.dim() == 2:
        return rewards + scores * mask_f
    lengths = mask.sum(1)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    rewards[rows, lengths[rows] - 1] += scores[rows]
    return rewards


@dataclass
class AdaptiveKL:
    """The KL coefficient: fixed, or adapted towards ``target`` (Ziegler et al., 2019, section 2.2)."""

    value: float
    target: float | None = None
    horizon: float = 10000.0

    def update(self, kl: float, samples: int) -> float:
        """Adapt to the measured mean KL of ``samples`` continuations; returns the new coefficient."""
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * samples / self.horizon
        return self.value


# ---- whitening ---------------------------------------------------------------------------------------------------


def whiten_stats(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of the masked values (float64), to sum across replicas."""
    v = values[mask].double()
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), (v * v).sum()])


def mean_and_std(stats: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased standard deviation from summed ``[count, sum, sum of squares]``."""
    n, s, ss = (float(x) for x in stats)
    if n == 0:
        return 0.0, 1.0
    mean = s / n
    var = (ss - n * mean * mean) / max(n - 1.0, 1.0)
    return mean, math.sqrt(max(var, 0.0))


def refuse_whitening_one(count: float, unit: str) -> None:
    """Refuse to whiten a batch that holds one ``unit`` (all replicas together): whitened, its advantage would be 0
    and the policy would learn nothing from the update, silently."""
    if count == 1:
        raise ValueError(f"whiten: the batch holds a single {unit} (all replicas together), whose whitened advantage "
                         f"is 0: the policy would learn nothing from it. Set the updater's whiten: false, or update "
                         f"on more than one {unit}; nothing was trained")


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, std: float, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / (std + eps)`` on the real tokens, zero elsewhere."""
    return (values - mean) / (std + eps) * mask


def whiten_batch(values: list[torch.Tensor], masks: list[torch.Tensor] | None, total, unit: str | None = None,
                 eps: float = 1e-8) -> list[torch.Tensor]:
    """Whiten every tensor of ``values`` with the mean and standard deviation of them all (on ``masks``' True
    entries, zero elsewhere; every entry, unmasked, without masks). ``total`` sums the local ``[count, sum, sum of
    squares]`` over every replica (the updater's ``trainer.sum_across_replicas``: one collective). With ``unit``,
    refuses a batch holding a single one (:func:`refuse_whitening_one`)."""
    every = [torch.ones_like(v, dtype=torch.bool) for v in values] if masks is None else masks
    stats = sum((whiten_stats(v, m) for v, m in zip(values, every)), torch.zeros(3, dtype=torch.float64))
    stats = total(stats)
    if unit is not None:
        refuse_whitening_one(float(stats[0]), unit)
    mean, std = mean_and_std(stats)
    if masks is None:
        return [(v - mean) / (std + eps) for v in values]
    return [whiten(v, m, mean, std, eps) for v, m in zip(values, masks)]


# ---- means over tokens, continuations and prompts ----------------------------------------------------------------


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[n]`` the mean of each row's real tokens (0 for a row without any)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)


def per_prompt_mean(values: torch.Tensor, candidate_context: torch.Tensor, num_contexts: int) -> torch.Tensor:
    """``[num_contexts]`` the mean of each prompt's per-continuation ``values`` (differentiable)."""
    index = candidate_context.to(values.device)
    counts = torch.bincount(index, minlength=num_contexts).to(values.dtype)
    sums = values.new_zeros(num_contexts).index_add(0, index, values)
    if values.numel() == 0:  # a replica with no sample must still reach the same weights as the others
        sums = keep_in_graph(sums, values)
    return sums / counts.clamp(min=1)


def per_prompt_token_mean(per_token: torch.Tensor, mask: torch.Tensor, candidate_context: torch.Tensor,
                          num_contexts: int) -> torch.Tensor:
    """``[num_contexts]`` each prompt's mean over all the real tokens of all its continuations (every token of the
    prompt weighs the same; differentiable)."""
    index = candidate_context.to(per_token.device)
    m = mask.to(per_token.dtype)
    sums = per_token.new_zeros(num_contexts).index_add(0, index, (per_token * m).sum(1))
    counts = per_token.new_zeros(num_contexts).index_add(0, index, m.sum(1))
    if per_token.numel() == 0:  # a replica with no token must still reach the same weights as the others
        sums = keep_in_graph(sums, per_token)
    return sums / counts.clamp(min=1)


AGGREGATIONS = ("sequence", "token", "batch_token", "fixed_length")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, candidate_context: torch.Tensor,
              num_contexts: int, *, max_new_tokens: int | None = None, step_tokens: float | None = None,
              num_replicas: int = 1) -> torch.Tensor:
    """A micro-batch's per-token losses ``[n, T]`` (``mask``: the real tokens) reduced as ``mode`` weighs them:

    - ``"sequence"``: ``[num_contexts]``, each continuation's token mean, then each prompt's mean over them;
    - ``"token"``: ``[num_contexts]``, each prompt's mean over all the real tokens of its continuations;
    - ``"fixed_length"``: ``[num_contexts]``, each continuation's token sum divided by ``max_new_tokens``, then each
      prompt's mean over them;
    - ``"batch_token"``: the scalar loss itself, the token sum times ``num_replicas / step_tokens`` (``step_tokens``:
      the real tokens of the whole optimizer step, every replica's; each token of the step weighs the same once the
      replicas' gradients are averaged).

    The per-prompt forms are averaged over the micro-batch's prompts by the caller (:meth:`UpdateBatch.mean`)."""
    if mode == "sequence":
        return per_prompt_mean(sequence_mean(per_token, mask), candidate_context, num_contexts)
    if mode == "token":
        return per_prompt_token_mean(per_token, mask, candidate_context, num_contexts)
    if mode == "fixed_length":
        per_continuation = (per_token * mask.to(per_token.dtype)).sum(1) / max_new_tokens
        return per_prompt_mean(per_continuation, candidate_context, num_contexts)
    if mode == "batch_token":
        return (per_token * mask).sum() * (num_replicas / max(step_tokens, 1.0))
    raise ValueError(f"unknown loss aggregation {mode!r}; the aggregations are {list(AGGREGATIONS)}")

# ---- re-exported: the engine's own maths and the submodules' ---------------------------------------------------

from llmrl.engine.episode_returns import group_episode_advantages, turn_returns  # noqa: E402,F401
from llmrl.engine.token_losses import (  # noqa: E402,F401
    OPTIONAL_INPUTS,
    TOKEN_LOSSES,
    UNREAD_WHEN_ZERO,
    register_token_loss,
    token_loss,
    token_loss_settings,
)
from llmrl.plugins.rl_math.dapo import keep_varied_groups, overlong_penalty  # noqa: E402,F401
from llmrl.plugins.rl_math.ilql import ilql_losses, polyak_update  # noqa: E402,F401
from llmrl.plugins.rl_math.kl import KL_ESTIMATORS, kl_estimate, kl_k3, kl_penalty  # noqa: E402,F401
from llmrl.plugins.rl_math.masking import masked_logprobs, top_p_mask  # noqa: E402,F401
from llmrl.plugins.rl_math.off_policy import (  # noqa: E402,F401
    OffPolicy,
    correct_datums,
    importance_weights,
    mismatch_stats,
)
from llmrl.plugins.rl_math.preference import preference_loss  # noqa: E402,F401
from llmrl.plugins.rl_math.variants import EntropySchedule, policy_loss  # noqa: E402,F401
