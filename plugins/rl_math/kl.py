"""The per-token KL estimators of Schulman ("Approximating KL Divergence", 2020), selectable by name (an updater's
``kl_estimator``): with ``d = logprob - ref_logprob`` on tokens sampled from the policy,

- ``k1 = d``: unbiased for KL(policy || reference), high variance, can be negative (``ppo_tokens``' default, in the
  reward);
- ``k2 = d^2 / 2``: biased, low variance, non-negative; its gradient is that of the reverse KL's second-order
  approximation;
- ``k3 = exp(-d) - 1 + d``: unbiased, non-negative (DeepSeekMath's; the default of ``grpo`` and the turn updaters
  in the loss).

Pure functions of tensors; the updaters choose where the estimate goes (in the loss, or in the per-token reward).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per token, ``exp(ref - logprob) - (ref - logprob) - 1``: the non-negative, unbiased estimator of
    KL(policy || reference) of DeepSeekMath (Schulman's k3)."""
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per token, the ``estimator`` (``k1``, ``k2`` or ``k3``) of KL(policy || reference) from the policy's and the
    reference's log-probs of the sampled tokens (differentiable in both)."""
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    raise ValueError(f"unknown kl_estimator {estimator!r}; the estimators are {list(KL_ESTIMATORS)}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, like: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """Per token, the KL ``estimator`` to the reference (:func:`kl_estimate`), or zeros shaped ``like`` without a
    reference (no KL term)."""
    return torch.zeros_like(like) if ref_logprobs is None else kl_estimate(logprobs, ref_logprobs, estimator)
