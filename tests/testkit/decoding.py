"""Helpers of the decoding tests: a plain forward's log-probs of given tokens, and whether two generate results hold
the same samples."""

from __future__ import annotations

import torch


def plain_logprobs(model, tok, prompt: str, tokens: list[int]) -> torch.Tensor:
    """The raw log-probs of ``tokens`` after ``prompt``: one plain forward, what ``score`` computes."""
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def same_samples(a, b) -> bool:
    """Whether two ``generate`` results hold the same prompts' samples: tokens, text and stop reason (and as many)."""
    return len(a) == len(b) and all(
        len(ra) == len(rb) and all(x["tokens"].tolist() == y["tokens"].tolist() and x["text"] == y["text"]
                                   and x["stop_reason"] == y["stop_reason"] for x, y in zip(ra, rb))
        for ra, rb in zip(a, b))
