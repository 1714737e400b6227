"""Float32 normalisation of logits: the precision every log-prob and entropy is computed in, and the entropy of a
row's softmax. Shared by the scoring results (:mod:`llmrl.engine.model.scoring.results`) and the chunked log-probs
of the updater's passes (:mod:`llmrl.engine.model.scoring.vocab_chunks`); it makes no model call.
"""

from __future__ import annotations

import torch


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or in its own dtype when that is wider (a float64 model keeps its precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def entropy_of(logits: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy (nats) of each row's softmax, in float32 (or wider); 0 log 0 counts 0 (and has a zero gradient)."""
    logits = at_least_float32(logits)
    logp = logits - (torch.logsumexp(logits, dim=-1) if norm is None else norm)[:, None]
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
