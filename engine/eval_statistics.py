"""The statistics of an evaluation, as pure functions: the unbiased pass@k estimator (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code": ``1 - C(n-c, k) / C(n, k)`` for ``c`` passes among ``n``
samples) and a confidence interval for a mean over prompts, by the normal approximation or a seeded percentile
bootstrap.

Both intervals treat the prompts as the sampled units: a prompt's value (its reward, or its pass@k estimate) is one
observation. The normal interval is ``mean ± z * s / sqrt(m)`` (``s`` the sample standard deviation, ``m`` the
number of prompts, ``z`` the standard normal quantile); the bootstrap resamples the prompts ``resamples`` times with
``random.Random(seed)`` and takes the percentiles of the resampled means. Either collapses to a point when every
prompt has the same value (no passes at all, say): more prompts, not a wider formula, are the cure. This module
generates nothing and knows no task.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

CI_METHODS = ("normal", "bootstrap")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``c`` passing samples among ``n``: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: ``k`` outside ``1..n`` or ``c`` outside ``0..n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: pass@k needs 1 <= k <= n (n={n} samples per prompt)")
    if not 0 <= c <= n:
        raise ValueError(f"c={c}: the number of passes lies in 0..n (n={n})")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def normal_quantile(confidence: float) -> float:
    """The ``z`` of a two-sided interval of this confidence (1.959964 for 0.95)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: give a level between 0 and 1 (0.95)")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def normal_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """``mean ± z * s / sqrt(m)``; None for fewer than 2 values (no spread to measure)."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = normal_quantile(confidence) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, seed: int = 0,
                       resamples: int = 2000) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean: ``resamples`` means of ``m`` values drawn with replacement
    (``random.Random(seed).choices``), sorted, and the ``(1-confidence)/2`` and ``(1+confidence)/2`` quantiles taken
    by index ``floor(q * (resamples - 1))``. None for fewer than 2 values."""
    if len(values) < 2:
        return None
    normal_quantile(confidence)  # checks the level
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    low = means[math.floor((1 - confidence) / 2 * (resamples - 1))]
    high = means[math.floor((1 + confidence) / 2 * (resamples - 1))]
    return low, high


def mean_interval(values: Sequence[float], method: str = "normal", confidence: float = 0.95,
                  seed: int = 0) -> dict:
    """``{"value": mean, "ci": [low, high] or None}`` for the mean of ``values`` by ``method`` (one of
    :data:`CI_METHODS`)."""
    if method not in CI_METHODS:
        raise ValueError(f"ci={method!r}: give one of {', '.join(CI_METHODS)}")
    if not values:
        raise ValueError("no values to average")
    ci = normal_interval(values, confidence) if method == "normal" else bootstrap_interval(values, confidence, seed)
    return {"value": statistics.fmean(values), "ci": list(ci) if ci else None}
