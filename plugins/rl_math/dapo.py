"""DAPO's client-side helpers (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):
the soft overlong punishment added to a continuation's reward (:func:`overlong_penalty`), and dynamic sampling's
filter that keeps only the groups whose rewards differ (:func:`keep_varied_groups`), reporting how many it dropped so
that the script samples more prompts to fill its batch. ``llmrl`` exports both for scripts.

What is not here: DAPO's clip-higher and token-level loss are ``grpo``'s ``clip_eps_high`` and ``loss:
batch_token``; nothing here samples, scores or calls a server.
"""

from __future__ import annotations

from dataclasses import dataclass


def overlong_penalty(length, max_length: int, cache_length: int):
    """DAPO's soft overlong punishment of a continuation of ``length`` tokens (a number, or a sequence of them):
    0 up to ``max_length - cache_length`` tokens, then falling linearly to -1 at ``max_length``
    (``((max_length - cache_length) - length) / cache_length``), and -1 beyond. Add it to the task reward.

    Example: ``overlong_penalty([10, 18, 25], max_length=20, cache_length=4)`` is ``[0.0, -0.5, -1.0]``."""
    if cache_length <= 0 or cache_length > max_length:
        raise ValueError(f"overlong_penalty needs 0 < cache_length <= max_length, got cache_length {cache_length} "
                         f"and max_length {max_length}")
    if not isinstance(length, (int, float)):
        return [overlong_penalty(x, max_length, cache_length) for x in length]
    start = max_length - cache_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache_length
    return -1.0


@dataclass(frozen=True)
class VariedGroups:
    """What :func:`keep_varied_groups` kept: the positions of the groups kept, and how many were dropped."""

    kept: list[int]
    dropped: int


def keep_varied_groups(rewards, tolerance: float = 0.0) -> VariedGroups:
    """DAPO's dynamic sampling filter: of per-group rewards (one sequence of rewards per prompt), the positions of
    the groups whose rewards are not all equal (within ``tolerance``). A group whose continuations all scored alike
    has advantage 0 everywhere in GRPO and trains nothing; the script drops it, counts ``dropped`` and samples more
    prompts until its batch is full.

    Example: ``keep_varied_groups([[1, 0], [1, 1], [0.5, 0.2]])`` keeps ``[0, 2]`` and drops 1."""
    groups, kept = list(rewards), []
    for i, group in enumerate(groups):
        values = [float(r) for r in group]
        if values and max(values) - min(values) > tolerance:
            kept.append(i)
    return VariedGroups(kept, len(groups) - len(kept))
