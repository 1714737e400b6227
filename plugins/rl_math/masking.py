"""The maths of ``nlpo``'s masked policy (Ramamurthy et al., 2023, "Is Reinforcement Learning (Not) for Natural
Language Processing?", RL4LMs): the top-p set of a masking policy's distribution, and a policy's log-probs and
entropy restricted to it.

It reads no batch and calls no model (:mod:`llmrl.plugins.nlpo` and :mod:`llmrl.plugins.steering` do).
"""

from __future__ import annotations

import torch


def top_p_mask(logits: torch.Tensor, top_p: float, always: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, vocab]`` bool: the tokens of each row's top-p set, the fewest most likely tokens whose probabilities
    sum to at least ``top_p`` (the likeliest is always in; ties at the edge are cut in sort order), as Hugging
    Face's top-p warper and RL4LMs' ``learned_top_p`` mask choose them. ``always`` (token ids) are added to every
    set (RL4LMs keeps the special tokens).

    The rule is the warper's own: drop the least likely tokens while their summed mass (from the bottom) is at most
    ``1 - top_p``. Summed from the top instead, float32 rounding reaches 1.0 before the tail: at ``top_p`` 1 a
    third of a 32k vocabulary was cut."""
    ordered, order = torch.sort(logits.float(), descending=False, dim=-1)
    keep_sorted = ordered.softmax(-1).cumsum(-1) > 1 - top_p
    keep_sorted[..., -1] = True
    allowed = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    if always is not None and always.numel():
        allowed[:, always.to(allowed.device)] = True
    return allowed


def masked_logprobs(logits: torch.Tensor, allowed: torch.Tensor, tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the log-prob of ``tokens[row]`` and the entropy of the distribution ``softmax(logits)`` restricted
    to (renormalised over) the ``allowed`` tokens. A token outside its set has log-prob ``-inf``."""
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(masked, -1)
    taken = logp.gather(-1, tokens[:, None]).squeeze(-1)
    p = logp.exp()
    entropy = -(p * logp.masked_fill(~allowed, 0.0)).sum(-1)
    return taken, entropy
