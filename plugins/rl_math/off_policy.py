"""Off-policy correction between the policy that sampled the tokens (the behaviour policy: the sampler's
``sampling_logprobs``, which may differ from the trainer's numerics, quantisation or weights version) and the policy
the update starts from (the old log-probs at collection): truncated or masked importance sampling, and the
statistics of their mismatch.

The weight of a token is ``w = exp(old_logprob - behaviour_logprob)``, taken at one of three levels: ``token`` (each
token's own), ``sequence`` (the product over the continuation's tokens, ``exp(sum log w)``, on every token) or
``geometric`` (the geometric mean over its tokens, ``exp(mean log w)``, on every token). The modes:

- ``none``: no correction (weight 1);
- ``tis``: truncated importance sampling, ``min(w, high)`` (``high`` the threshold C; default 2);
- ``mis``: masked importance sampling, ``w`` where ``low <= w <= high`` and 0 elsewhere (defaults 0 and 2: only
  weights above C are masked);
- ``icepop``: IcePop's two-sided mask (Ring-1T), the same rule as ``mis`` with IcePop's bounds, 0.5 and 5 by default.

The weight multiplies each token's policy term (a masked token's policy term is 0 but its token still counts in the
loss's normalisation); KL and entropy terms are not weighed. :func:`mismatch_stats` reports KL(behaviour || policy)
(the k3 estimator from behaviour samples, ``w - 1 - log w``), the chi-squared divergence (``mean(w^2) - 1``), the
token ratios' mean and max and the share of tokens whose weight was truncated or masked. :func:`correct_datums`
applies the correction to ``forward_backward`` datums client-side (every built-in token loss is linear in the
advantage at each token, so weighing the policy term is weighing the advantage).

Pure functions of tensors: nothing here reads a batch, calls the model or talks to other replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")
DEFAULT_BOUNDS = {"none": (None, None), "tis": (None, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}

@dataclass(frozen=True)
class OffPolicy:
    """An off-policy correction: ``mode``, ``level`` and the bounds ``[low, high]`` (see the module's docstring)."""

    mode: str = "none"
    level: str = "token"
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, args: dict | None) -> OffPolicy:
        """From an updater's ``off_policy`` argument (None: no correction), the mode's default bounds filled in.
        Raises ValueError naming the key at fault."""
        args = dict(args or {})
        unknown = sorted(set(args) - {"mode", "level", "low", "high"})
        if unknown:
            raise ValueError(f"off_policy has unknown key(s) {unknown}; it takes mode, level, low and high")
        mode, level = args.get("mode", "none"), args.get("level", "token")
        if mode not in MODES or level not in LEVELS:
            raise ValueError(f"off_policy mode {mode!r} / level {level!r}: the modes are {list(MODES)}, the levels "
                             f"{list(LEVELS)}")
        low, high = DEFAULT_BOUNDS[mode]
        low, high = args.get("low", low), args.get("high", high)
        if mode == "tis" and "low" in args:
            raise ValueError("off_policy mode tis truncates the weight at high only; drop low (or use mode mis)")
        if mode == "none" and ("low" in args or "high" in args):
            raise ValueError("off_policy mode none corrects nothing: drop low and high, or choose tis, mis or icepop")
        if low is not None and high is not None and not low <= 1.0 <= high:
            raise ValueError(f"off_policy bounds [{low}, {high}] must hold the weight 1 (low <= 1 <= high): they "
                             "bound the importance weight, not its distance to 1")
        return cls(mode, level, low, high)

    @property
    def active(self) -> bool:
        return self.mode != "none"


def level_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``[n, T]`` the log importance weight of every token at ``level``: its own ``log_ratio`` (``token``), its
    row's sum over the real tokens (``sequence``) or their mean (``geometric``); 0 outside ``mask``."""
    m = mask.to(log_ratio.dtype)
    masked = log_ratio * m
    if level == "token":
        return masked
    total = masked.sum(-1, keepdim=True)
    if level == "geometric":
        total = total / m.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown off_policy level {level!r}; the levels are {list(LEVELS)}")
    return total * m


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, options: OffPolicy
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, corrected)``, both ``[n, T]`` and detached: the corrected importance weight of every token
    (``log_ratio`` = old - behaviour log-probs; ``mask`` the real tokens) and 1.0 where it was truncated or masked;
    weights are 1 and corrected 0 outside ``mask`` and with mode ``none``."""
    log_ratio = log_ratio.detach().float()
    if not options.active:
        return torch.ones_like(log_ratio), torch.zeros_like(log_ratio)
    w = torch.exp(level_log_weights(log_ratio, mask, options.level))
    if options.mode == "tis":
        corrected = w > options.high
        weights = torch.clamp(w, max=options.high)
    else:  # mis, icepop: masked outside [low, high]
        corrected = (w < options.low) | (w > options.high)
        weights = torch.where(corrected, 0.0, w)
    corrected = corrected & mask.bool()
    return torch.where(mask.bool(), weights, 1.0), corrected.float()


def mismatch_stats(log_ratio: torch.Tensor, corrected: torch.Tensor | None = None, prefix: str = "off_policy_"
                   ) -> dict[str, float]:
    """The behaviour-to-policy mismatch over the real tokens' ``log_ratio`` (1-D: old - behaviour log-probs):
    ``kl`` (KL(behaviour || policy), the k3 estimator ``w - 1 - log w``), ``chi2`` (``mean(w^2) - 1``),
    ``ratio_mean`` and ``ratio_max`` of ``w``, and ``corrected`` (the share of ``corrected``, 0 without it); each
    key with ``prefix``. Zeros for no token."""
    log_ratio = log_ratio.detach().double().flatten()
    if log_ratio.numel() == 0:
        return {prefix + key: 0.0 for key in ("kl", "chi2", "ratio_mean", "ratio_max", "corrected")}
    w = torch.exp(log_ratio)
    share = 0.0 if corrected is None else float(corrected.double().flatten().mean())
    return {prefix + "kl": float((w - 1.0 - log_ratio).mean()), prefix + "chi2": float((w * w).mean() - 1.0),
            prefix + "ratio_mean": float(w.mean()), prefix + "ratio_max": float(w.max()),
            prefix + "corrected": share}


def correct_datums(data: list[dict], off_policy: dict | OffPolicy) -> tuple[list[dict], dict[str, float]]:
    """Apply an off-policy correction to ``forward_backward`` datums, client-side: each datum's ``loss_fn_inputs``
    holds ``behaviour_logprobs`` (the sampler's, one per target token) next to ``logprobs`` (the policy's at
    collection, which the loss's ratio starts from) and ``advantages``; returns new datums whose advantages are
    multiplied by the corrected weights (:func:`importance_weights`; a datum's tokens are those with a non-zero
    advantage, which every built-in loss but ``dro`` leaves unread otherwise) and without ``behaviour_logprobs``,
    and the mismatch statistics over all their tokens (:func:`mismatch_stats`).

    Every built-in loss (``importance_sampling``, ``ppo``, ``cispo``, ``gspo``, ``dro``) is, at each token, its
    policy term times the advantage (the PPO minimum of ``w * x`` and ``w * y`` is ``w`` times theirs, ``w >= 0``), so
    this is the corrected loss; ``dro``'s quadratic penalty is not weighed."""
    options = off_policy if isinstance(off_policy, OffPolicy) else OffPolicy.of(off_policy)
    out, ratios, corrected = [], [], []
    for i, datum in enumerate(data):
        inputs = dict(datum["loss_fn_inputs"])
        if "behaviour_logprobs" not in inputs or "logprobs" not in inputs or "advantages" not in inputs:
            raise ValueError(f"data[{i}]['loss_fn_inputs'] needs behaviour_logprobs, logprobs and advantages for an "
                             "off-policy correction")
        behaviour = torch.as_tensor(inputs.pop("behaviour_logprobs"), dtype=torch.float32)
        advantages = torch.as_tensor(inputs["advantages"], dtype=torch.float32)
        log_ratio = torch.as_tensor(inputs["logprobs"], dtype=torch.float32) - behaviour
        mask = advantages != 0
        weights, hit = importance_weights(log_ratio[None], mask[None], options)
        inputs["advantages"] = (advantages * weights[0]).tolist()
        ratios.append(log_ratio[mask])
        corrected.append(hit[0][mask])
        out.append({**datum, "loss_fn_inputs": inputs})
    stats = mismatch_stats(torch.cat(ratios) if ratios else torch.zeros(0),
                           torch.cat(corrected) if corrected else None)
    return out, stats
