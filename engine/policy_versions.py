"""Policy versions: which weights a sample was drawn from, and how stale a sample is when it is trained on.

A policy version is a count of optimizer steps: a LoRA adapter's version is the number of optimizer steps that
adapter took (the engine counts them, :mod:`llmrl.engine.model.version_counts`), a snapshot's is the version of its
source when it was taken, and a model trained without LoRA has one version, its own step count. Every ``generate``
sample carries ``policy_version`` (an int) and ``policy`` (the adapter or snapshot it was drawn from, None for a
model without adapters). A sample's *staleness* when a step trains on it is the trained weights' version then,
minus the sample's version: 0 for a sample of the very weights being trained, k after k steps.

The training calls take the samples' versions as ``policy_versions``: one entry per sample, an int, or nested
lists of ints (a multi-turn episode: one version per turn, one list per episode of a group). This module holds the
pure arithmetic both halves share (flattening, checking, the statistics); it counts no step and sends nothing.
"""

from __future__ import annotations

import numbers


def flat_versions(value) -> list[int]:
    """Every version in ``value`` (an int, or nested lists or tuples of ints), in order."""
    if isinstance(value, (list, tuple)):
        return [v for entry in value for v in flat_versions(entry)]
    if hasattr(value, "tolist"):
        return flat_versions(value.tolist())
    return [int(value)]


def version_problem(value) -> str | None:
    """Why ``value`` is not a policy version entry (an int >= 0, or nested lists of them), or None."""
    if isinstance(value, (list, tuple)):
        for entry in value:
            problem = version_problem(entry)
            if problem is not None:
                return problem
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"{type(value).__name__} {value!r} is not an int"
    if value < 0:
        return f"{value} is negative"
    return None


def check_policy_versions(value, n: int, where: str) -> list:
    """``value`` as a list of ``n`` entries, each an int >= 0 or nested lists of them; raises ValueError naming
    ``where`` and the first entry at fault."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list with one policy version per sample, got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{where} has {len(value)} entries, but the call has {n} samples: give one policy version "
                         "(or one list of them, per turn) per sample")
    for i, entry in enumerate(value):
        problem = version_problem(entry)
        if problem is not None:
            raise ValueError(f"{where}[{i}]: {problem}; a policy version is a sample's policy_version, an int >= 0")
    return list(value)


def staleness(current: int, versions) -> list[int]:
    """Each version's staleness against the ``current`` version (``current - version``), flattened."""
    return [int(current) - v for v in flat_versions(versions)]


def staleness_stats(values: list[int]) -> dict[str, float]:
    """``staleness_mean`` and ``staleness_max`` of staleness values (nothing when there are none)."""
    if not values:
        return {}
    return {"staleness_mean": sum(values) / len(values), "staleness_max": float(max(values))}
