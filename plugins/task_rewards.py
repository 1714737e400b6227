"""The task rewards of token-level PPO (``ppo_tokens``) before the KL penalty joins them: laid out per token, then
clipped and scaled as trlX's ``cliprange_reward`` and ``scale_reward`` do.

A continuation's task reward is a number (the reward model's or the task's score, counted on its last token) or a
dense sequence with one number per generated token; :func:`last_token_rows` lays numbers out as per-token rows, so
that both are ``[n, T]`` rows from then on. :class:`RewardScaler` clips every value to ``[-clip, clip]``, then divides
every value by a standard deviation of the continuations' total (summed) rewards: ``running``, that of every
continuation of every update so far, this one's included (:class:`RunningMoments`, trlX's formulas); ``ref``, a
given one, or else that of the first update's continuations. That is trlX's order (clip, then scale) and its
choice of statistic.

What is not here: the statistics are the whole batch's, summed across replicas by the updater
(:meth:`RewardScaler.batch_stats` gives the sums to add), which also saves the scaler's state in checkpoints. This
module reads no batch and talks to no replica; reading the rewards from ``update``'s arguments is
:mod:`llmrl.plugins.rollouts`' job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SCALES = (None, "running", "ref")
MIN_STD = 1e-8  # a smaller standard deviation (every total reward equal so far) leaves the rewards unscaled


def last_token_rows(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[n, T]`` float32 rows holding ``scores[i]`` on row ``i``'s last real token and zeros elsewhere: a reward per
    continuation laid out as dense per-token rewards (a row without a real token gets nothing)."""
    rows = torch.zeros(mask.shape, dtype=torch.float32)
    lengths = mask.sum(1)
    real = torch.nonzero(lengths > 0).squeeze(1)
    rows[real, lengths[real] - 1] = scores[real].float()
    return rows


@dataclass
class RunningMoments:
    """The running mean and variance of a stream of numbers, merged a batch at a time from each batch's count, mean
    and biased variance (trlX's ``RunningMoments``, after stable-baselines3's ``RunningMeanStd``). It starts as
    trlX's does (mean 0, variance 1, count 1e-24), so that the first batch's moments replace the start."""

    mean: float = 0.0
    var: float = 1.0  # biased
    count: float = 1e-24

    @property
    def std(self) -> float:
        """The unbiased standard deviation of every number seen (1 until two numbers were seen)."""
        if self.count < 2:
            return 1.0
        return math.sqrt(max(self.var * self.count / (self.count - 1.0), 0.0))

    def update(self, count: float, mean: float, var: float) -> None:
        """Merge a batch of ``count`` numbers of this ``mean`` and biased variance ``var``."""
        if count <= 0:
            return
        delta = mean - self.mean
        total = self.count + count
        old_sum = self.var * self.count + delta * delta * self.count * count / total
        self.mean += delta * count / total
        self.var = (old_sum + var * count) / total
        self.count = total


@dataclass
class RewardScaler:
    """trlX's ``cliprange_reward`` (``clip``: every value clipped to ``[-clip, clip]``; None: no clip) and
    ``scale_reward`` (``scale``: None, ``"running"`` or ``"ref"``, with ``ref_std`` given or taken from the first
    update). A standard deviation under :data:`MIN_STD` (every total reward equal so far) leaves the rewards
    unscaled."""

    clip: float | None = None
    scale: str | None = None
    ref_std: float | None = None
    moments: RunningMoments = field(default_factory=RunningMoments)

    def clipped(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.clip is None else rows.clamp(-self.clip, self.clip)

    @staticmethod
    def batch_stats(rows: list[torch.Tensor]) -> torch.Tensor:
        """``[count, sum, sum of squares]`` (float64) of the continuations' total rewards (each ``[k, T]`` row set's
        sums over tokens), to sum across replicas and hand to :meth:`divisor`."""
        totals = torch.cat([r.double().sum(1) for r in rows]) if rows else torch.zeros(0, dtype=torch.float64)
        return torch.stack([torch.tensor(float(totals.numel()), dtype=torch.float64), totals.sum(),
                            (totals * totals).sum()])

    def divisor(self, stats: torch.Tensor) -> float:
        """The number this update's (clipped) rewards are divided by, given the whole batch's
        :meth:`batch_stats`; updates the running moments (``running``) or fixes ``ref_std`` (``ref``, first call)."""
        if self.scale is None:
            return 1.0
        n, total, squares = (float(x) for x in stats)
        mean = total / n if n else 0.0
        var = max(squares / n - mean * mean, 0.0) if n else 0.0  # biased
        if self.scale == "running":
            self.moments.update(n, mean, var)
            std = self.moments.std
        else:
            if self.ref_std is None:
                self.ref_std = math.sqrt(var * n / (n - 1.0)) if n >= 2 else 1.0
            std = self.ref_std
        return std if std > MIN_STD else 1.0

    def state_dict(self) -> dict:
        return {"moments": [self.moments.mean, self.moments.var, self.moments.count], "ref_std": self.ref_std}

    def load_state_dict(self, state: dict) -> None:
        self.moments = RunningMoments(*(float(x) for x in state["moments"]))
        if self.ref_std is None:  # taken from the first update: the run's; given in the config: the config's
            self.ref_std = None if state["ref_std"] is None else float(state["ref_std"])
