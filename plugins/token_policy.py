"""The training loop the token-level policy updaters share (``grpo``, ``ppo_tokens`` and ``nlpo``, ``ppo_turns`` and
``grpo_turns``): ``epochs`` passes over the batch in minibatches shuffled by the updater's generator, one backward
pass and one optimizer (micro-)step per minibatch, and the statistics of the passes summed over the tokens each
minibatch names.

What a minibatch's loss is, and which statistics it adds, is the updater's: it passes :func:`train_epochs` a
function ``(trainer, minibatch) -> MinibatchTerms`` (:data:`MinibatchLoss`), which receives a :class:`Minibatch`
(the sub-batch, the first pass's rows of its samples and, for ``grpo``'s ``batch_token`` loss, its optimizer step's
token total) and returns :class:`MinibatchTerms` (the scalar to back-propagate, per-token terms to report and
other sums). :func:`policy_forward` is the training pass most of them make. :func:`off_policy_weights` sets, once
per update, each sample's importance weights from the sampler's ``behaviour_logprobs`` (the updaters' ``off_policy``
argument; the maths is :mod:`llmrl.plugins.rl_math.off_policy`) and gives the mismatch statistics.

This module computes no loss, no advantage and no statistic of its own, reads no per-sample argument and runs no
first pass (:mod:`llmrl.plugins.rollouts` does); the maths is in :mod:`llmrl.plugins.rl_math`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmrl.plugins.contracts import Trainer, UpdateBatch
from llmrl.plugins.rl_math.off_policy import OffPolicy, importance_weights, mismatch_stats
from llmrl.plugins.rollouts import PromptRows, join_prompts


@dataclass(frozen=True)
class Minibatch:
    """One micro-step's share of the batch, as the updater's loss function receives it."""

    batch: UpdateBatch  # the sub-batch: contexts, candidates, and ``mean`` over the step's samples
    rows: list[PromptRows]  # the first pass's rows of its samples, in the sub-batch's order
    step_tokens: float | None = None  # the real tokens of its optimizer step, every replica's (when counted)

    def take(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """``[n, T]`` rows of ``key`` for these samples (:func:`~llmrl.plugins.rollouts.join_prompts`), as wide
        as ``like`` and on its device."""
        return join_prompts(self.rows, key, like.shape[1], like.device)


@dataclass
class MinibatchTerms:
    """What a minibatch's loss function returns."""

    loss: torch.Tensor  # the scalar back-propagated (already averaged as the updater weighs its samples)
    mask: torch.Tensor  # [n, T] bool: the tokens the per-token statistics are summed over (and counted)
    per_token: dict[str, torch.Tensor | None]  # [n, T] terms reported per token, in this order (None: not reported)
    sums: dict[str, float] = field(default_factory=dict)  # other statistics, summed as given


MinibatchLoss = Callable[[Trainer, Minibatch], MinibatchTerms]


@dataclass
class EpochTotals:
    """The statistics of every minibatch of every epoch: per-token sums over ``tokens`` masked tokens, and the
    other sums."""

    tokens: float = 0.0
    token_sums: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def token_means(self) -> dict[str, float]:
        """Each per-token statistic's mean over the masked tokens of every pass."""
        return {key: value / max(self.tokens, 1.0) for key, value in self.token_sums.items()}

    def add(self, terms: MinibatchTerms) -> None:
        """Add one minibatch's statistics (detached; a term outside the mask counts 0, whatever its value)."""
        self.tokens += float(terms.mask.sum())
        for key, value in terms.per_token.items():
            if value is not None:
                masked = torch.where(terms.mask, value.detach(), 0.0)
                self.token_sums[key] = self.token_sums.get(key, 0.0) + float(masked.sum())
        for key, value in terms.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value


def train_epochs(batch: UpdateBatch, trainer: Trainer, prompts: list[PromptRows], loss_of: MinibatchLoss,
                 epochs: int, generator: torch.Generator, step_token_counts: dict[int, float] | None = None
                 ) -> EpochTotals:
    """Run ``epochs`` passes over ``batch`` (``prompts``: the first pass's rows of its samples, in its order):
    per minibatch of ``trainer.micro_batch_size`` samples, shuffled by ``generator``, ``loss_of(trainer,
    minibatch)``, a backward pass of its loss and an optimizer (micro-)step.

    Args:
        step_token_counts: per sample (by its index in the call), its tokens; given, each minibatch gets its
            optimizer step's total over every replica (:meth:`UpdateBatch.step_totals`, one collective per epoch).

    Returns:
        The summed statistics of every minibatch (:class:`EpochTotals`).
    """
    position = {index: k for k, index in enumerate(batch.indices)}
    totals = EpochTotals()
    for _ in range(epochs):
        step_tokens = iter(() if step_token_counts is None else batch.step_totals(
            trainer.micro_batch_size, step_token_counts, trainer.sum_across_replicas, generator))
        for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=generator):
            rows = [prompts[position[i]] for i in mb.indices]
            terms = loss_of(trainer, Minibatch(mb, rows, next(step_tokens, None)))
            trainer.backward(terms.loss)
            trainer.step()
            totals.add(terms)
    return totals


def policy_forward(trainer: Trainer, mb: UpdateBatch, peft_adapter: str | None, heads: list | tuple = (),
                   entropy: bool = False) -> tuple:
    """One training pass of the policy over a minibatch: its outputs, ``[n, T]`` log-probs and mask, and (with
    ``entropy``) the ``[n, T]`` float32 entropies, else None."""
    out = trainer.forward(mb.contexts, mb.candidates, heads=heads, peft_adapter=peft_adapter, per_token=True,
                          entropy=entropy)
    logp, mask = out.tokens_by_candidate()
    return out, logp, mask, out.tokens_by_candidate(out.token_entropy)[0].float() if entropy else None


def check_off_policy(batch: UpdateBatch, options: OffPolicy, name: str) -> None:
    """Refuse, before any pass, a correction without the sampler's log-probs to correct from."""
    if options.active and "behaviour_logprobs" not in batch.kwargs:
        raise ValueError(f"{name}'s off_policy mode {options.mode!r} weighs each token by exp(old_logprob - "
                         "behaviour_logprob): pass behaviour_logprobs (per continuation, the sampler's log-prob of "
                         "each token: generate's sampling_logprobs) in caller.update(...), or set off_policy mode none")


def off_policy_weights(prompts: list[PromptRows], options: OffPolicy, mask_key: str | None = None
                       ) -> dict[str, float]:
    """With the sampler's ``behaviour_logprobs`` in the rows: each prompt's ``[k, T]`` ``is_weights`` (its
    importance weights over its tokens, ``mask`` or ``tensors[mask_key]``; set only when ``options`` corrects) and
    the mismatch statistics of this replica's tokens (:func:`~llmrl.plugins.rl_math.off_policy.mismatch_stats`).
    Without them: no weights and no statistics."""
    if not prompts or "behaviour_logprobs" not in prompts[0].tensors:
        return {}
    ratios, corrected = [], []
    for p in prompts:
        mask = p.mask if mask_key is None else p.tensors[mask_key].bool()
        log_ratio = p.tensors["old_logprobs"] - p.tensors["behaviour_logprobs"]
        weights, hit = importance_weights(log_ratio, mask, options)
        if options.active:
            p.tensors["is_weights"] = weights
        ratios.append(log_ratio[mask])
        corrected.append(hit[mask])
    return mismatch_stats(torch.cat(ratios), torch.cat(corrected))
