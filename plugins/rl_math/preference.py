"""The preference losses of the ``dpo`` updater (:func:`preference_loss`: DPO's sigmoid loss with label smoothing,
robust DPO and IPO), as a pure function of summed (or per-token mean) log-probs.

It reads no batch and calls no model (:mod:`llmrl.plugins.dpo` does).
"""

from __future__ import annotations

import torch


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                    beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and the implicit rewards ``beta * (logp - ref_logp)`` of the chosen and the rejected.

    With ``h = (chosen - ref_chosen) - (rejected - ref_rejected)`` and ``e = label_smoothing``:
    ``sigmoid`` (DPO, Rafailov et al. 2023; with ``e > 0`` conservative DPO)
    ``-(1 - e) log s(beta h) - e log s(-beta h)``;
    ``robust`` (Chowdhury et al. 2024, preferences flipped with probability ``e``)
    ``(-(1 - e) log s(beta h) + e log s(-beta h)) / (1 - 2e)``; ``ipo`` (Azar et al. 2023) ``(h - 1 / (2 beta))^2``,
    given per-token mean log-probs as IPO defines it."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if kind == "sigmoid":
        loss = -(1 - label_smoothing) * torch.nn.functional.logsigmoid(beta * h) \
            - label_smoothing * torch.nn.functional.logsigmoid(-beta * h)
    elif kind == "robust":
        loss = (-(1 - label_smoothing) * torch.nn.functional.logsigmoid(beta * h)
                + label_smoothing * torch.nn.functional.logsigmoid(-beta * h)) / (1 - 2 * label_smoothing)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}: sigmoid, robust or ipo")
    return loss, (beta * (chosen - ref_chosen)).detach(), (beta * (rejected - ref_rejected)).detach()
