"""The per-token losses of client-owned training steps (``forward_backward``): :func:`token_loss` (``cross_entropy``,
``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``, with Tinker's names, inputs and definitions), the
checks of their configuration (:func:`token_loss_settings`) and the tables of the inputs each reads
(:data:`TOKEN_LOSSES`, :data:`OPTIONAL_INPUTS`, :data:`UNREAD_WHEN_ZERO`).

Pure functions of tensors, at the engine's level because the engine serves these losses itself (the client checks a
call's loss, a replica computes it); :mod:`llmrl.plugins.rl_math` re-exports them for plugins and scripts. Nothing
here reads a request, calls the model or checks a datum (:mod:`llmrl.engine.requests.datums` does).
"""

from __future__ import annotations

import math
import numbers

import torch

# Per loss: the per-token inputs it reads besides the log-probs, and its configuration with the defaults.
TOKEN_LOSSES = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),  # Tinker's
    "dro": (("logprobs", "advantages"), {"beta": None}),
    "gspo": (("logprobs", "advantages", "sequence_ratio_mask"),
             {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
}

# Per loss: per-token inputs a datum may add (the tinker SDK's Datum lists them): each token's own clip thresholds,
# in place of loss_fn_config's.
OPTIONAL_INPUTS = {name: ("clip_low_threshold", "clip_high_threshold") for name in ("ppo", "cispo", "gspo")}

# Per loss: the inputs that, all 0 at a position, make its loss and gradient there 0 whatever the log-prob (dro's
# penalty reads every position). Only there may a datum's target differ from the next input token.
UNREAD_WHEN_ZERO = {"cross_entropy": ("weights",), "importance_sampling": ("advantages",), "ppo": ("advantages",),
                    "cispo": ("advantages",), "gspo": ("advantages", "sequence_ratio_mask")}


def token_loss(name: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None = None
               ) -> torch.Tensor:
    """Per-token losses ``[T]`` of one sequence; their sum is the sequence's loss. ``logprobs`` are the model's
    log-probs of the target tokens (differentiable); ``inputs["logprobs"]`` are the sampler's.

    - ``cross_entropy``: ``-weights * logp``;
    - ``importance_sampling``: ``-exp(logp - logp_sampler) * advantages``;
    - ``ppo``: ``-min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A)``, ``ratio =
      exp(logp - logp_sampler)`` (thresholds are bounds on the ratio: 0.8 and 1.2 by default; per-token inputs of
      those names, where a datum gives them, replace loss_fn_config's, for ``cispo`` and ``gspo`` too);
    - ``cispo``: ``-sg(clip(ratio, low, high)) * A * logp`` (the clipped ratio weighs the log-prob's gradient and gets
      none of its own); by default one-sided, as Tinker's: 0.0 and 4.0 (a lower bound would keep near-full updates on
      tokens the policy has moved away from);
    - ``dro``: ``-(logp * A - beta / 2 * (logp - logp_sampler) ** 2)`` (``beta`` required);
    - ``gspo`` (GSPO-token): ``ppo``'s loss with every token's ratio worth the sequence ratio ``s = exp(mean over
      the tokens sequence_ratio_mask marks of (logp - logp_sampler))`` and carrying its own log-prob's gradient:
      ``ratio_t = sg(s) * exp(logp_t - sg(logp_t))`` (a sequence with no marked token has ``s = 1``).

    Raises ValueError naming the loss and the input or key at fault (an unknown loss, a missing input or key, an
    unknown key, an input whose length is not the log-probs').
    """
    needed, _ = TOKEN_LOSSES[name] if name in TOKEN_LOSSES else ((), {})
    settings = token_loss_settings(name, config)
    for key in needed:
        if key not in inputs:
            raise ValueError(f"loss_fn {name!r} needs the per-token input {key!r} in every datum's loss_fn_inputs")
        if inputs[key].shape != logprobs.shape:
            raise ValueError(f"loss_fn_inputs[{key!r}] has {tuple(inputs[key].shape)} values but the datum has "
                             f"{tuple(logprobs.shape)} target tokens: give one value per target token")
    if name == "cross_entropy":
        return -inputs["weights"] * logprobs
    advantages, sampler = inputs["advantages"], inputs["logprobs"]
    ratio = torch.exp(logprobs - sampler)
    if name == "importance_sampling":
        return -ratio * advantages
    low, high = (torch.as_tensor(inputs.get(key, settings.get(key)), dtype=ratio.dtype, device=ratio.device)
                 for key in ("clip_low_threshold", "clip_high_threshold")) if name in OPTIONAL_INPUTS else (None, None)
    if name == "ppo":
        return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if name == "cispo":
        return -torch.clamp(ratio, low, high).detach() * advantages * logprobs
    if name == "gspo":
        marked = inputs["sequence_ratio_mask"] != 0
        log_ratio = (logprobs.detach() - sampler)[marked].sum() / marked.sum().clamp(min=1)
        ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
        return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    return -(logprobs * advantages - 0.5 * settings["beta"] * (logprobs - sampler) ** 2)


def token_loss_settings(name: str, config: dict | None) -> dict:
    """The configuration of loss ``name``: ``config`` over the defaults. Raises ValueError naming the loss and the
    key at fault (an unknown loss, an unknown key, a required key missing or not a number)."""
    if name not in TOKEN_LOSSES:
        raise ValueError(f"unknown loss_fn {name!r}; the built-in losses are {sorted(TOKEN_LOSSES)}")
    _, defaults = TOKEN_LOSSES[name]
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"loss_fn_config of {name!r} has unknown key(s) {unknown}; it takes {sorted(defaults)}")
    settings = {**defaults, **config}
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"loss_fn {name!r} needs loss_fn_config[{key!r}] to be a finite number, got {value!r}")
    low, high = settings.get("clip_low_threshold"), settings.get("clip_high_threshold")
    if low is not None and not 0 <= low <= 1 <= high:  # 0.2 / 0.28 (the epsilons) would clip every ratio of 1
        raise ValueError(f"loss_fn {name!r} clips the probability ratio to [clip_low_threshold, clip_high_threshold] "
                         f"= [{low}, {high}]; these are ratios with 0 <= low <= 1 <= high (1 - eps and 1 + eps, "
                         "e.g. 0.8 and 1.2), not the epsilons themselves")
    if settings.get("beta") is not None and settings["beta"] < 0:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_config['beta'] >= 0 (the weight of its quadratic penalty), "
                         f"got {settings['beta']}")
    return settings
