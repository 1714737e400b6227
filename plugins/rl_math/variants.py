"""The policy-loss variants and the entropy schedule of the token-level policy updaters.

:func:`policy_loss` gives ``grpo``'s per-token policy term for its ``policy_loss`` argument: ``ppo`` (the clipped
surrogate, :func:`~llmrl.plugins.rl_math.clipped_surrogate`), ``gspo`` (GSPO-token, Zheng et al., 2025: every
token's ratio worth its continuation's sequence ratio, the geometric mean of its token ratios) or ``cispo``
(MiniMax-M1, 2025: the clipped ratio, without gradient, weighs ``-A * logprob``). GSPO's and CISPO's maths are the
token losses of ``forward_backward`` (:mod:`llmrl.engine.token_losses`), called here on rows; this module only maps
the updater's ratio bounds onto them. :class:`EntropySchedule` is an updater's ``entropy_coef``: a number (constant)
or ``{start, end, updates}`` (linear from ``start`` to ``end`` over ``updates`` updates, then ``end``).

Pure functions of tensors and a small value object; nothing here reads a batch or calls the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrl.engine.token_losses import cispo, clipped_ratio_loss, gspo

POLICY_LOSSES = ("ppo", "gspo", "cispo")


def policy_loss(name: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, clipped)``, both ``[n, T]``: the per-token policy term ``name`` of rows of ``logprobs`` against
    ``old_logprobs`` with per-token ``advantages`` (``mask``: the real tokens, which ``gspo``'s sequence ratio is
    taken over), the ratio bounded to ``[low, high]``; and, detached, 1.0 where the ratio that term clips (the
    token's, or for ``gspo`` the sequence's) left the bounds."""
    inputs = {"logprobs": old_logprobs, "advantages": advantages, "sequence_ratio_mask": mask.to(logprobs.dtype)}
    bounds = {"clip_low_threshold": low, "clip_high_threshold": high}
    if name == "ppo":
        ratio = torch.exp(logprobs - old_logprobs)
        loss = clipped_ratio_loss(ratio, advantages, low, high)
    elif name == "gspo":
        loss = gspo(logprobs, inputs, bounds)
        ratio = torch.exp(torch.where(mask, logprobs.detach() - old_logprobs, 0.0).sum(-1, keepdim=True)
                          / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(logprobs)
    elif name == "cispo":
        loss = cispo(logprobs, inputs, bounds)
        ratio = torch.exp(logprobs - old_logprobs)
    else:
        raise ValueError(f"unknown policy_loss {name!r}; the policy losses are {list(POLICY_LOSSES)}")
    return loss, ((ratio < low) | (ratio > high)).float().detach()


@dataclass(frozen=True)
class EntropySchedule:
    """The entropy bonus's coefficient at each update: ``start``, moving linearly to ``end`` over ``updates``
    updates, then ``end`` (``updates`` None: constant ``start``)."""

    start: float = 0.0
    end: float = 0.0
    updates: int | None = None

    @classmethod
    def of(cls, value: float | dict) -> EntropySchedule:
        """From an updater's ``entropy_coef``: a number (constant) or ``{start, end, updates}``."""
        if isinstance(value, dict):
            return cls(float(value["start"]), float(value["end"]), int(value["updates"]))
        return cls(value, value, None)

    @property
    def scheduled(self) -> bool:
        return self.updates is not None

    def at(self, done: int) -> float:
        """The coefficient of the update after ``done`` updates."""
        if self.updates is None:
            return self.start
        return self.start + (self.end - self.start) * min(done / self.updates, 1.0)
