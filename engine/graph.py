"""Zeros that keep tensors in the backward graph: "every weight reaches the loss, with weight zero".

Data-parallel replicas must run the same backward: under ZeRO each one gathers and reduces the same weights in
the same order, so a replica whose share of a batch is empty (no sample, no token) or whose loss reads only part
of a pass must still reach every weight the others reach. The idiom is to add ``0.0 * t.sum()`` of the unread
tensors to what the loss reads; this module names it once. It changes no value (``x + 0.0 == x`` for finite
sums) and does not decide which tensors must be tied: the callers do (scoring results, ``ForwardOutputs``' padded
views, the updaters' per-prompt means).
"""

from __future__ import annotations

import torch


def graph_zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dimensional zero whose backward reaches every one of ``tensors`` (summed in float32)."""
    return 0.0 * sum(t.float().sum() for t in tensors)


def plus_zero(value, zero: torch.Tensor):
    """``value`` (a tensor, a dict of tensors, or None) plus the graph zero ``zero``, keeping its dtype."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: v + zero for k, v in value.items()}
    return value + zero


def keep_in_graph(value: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """``value`` unchanged in every number, but tied to ``tensors`` so that a backward from it reaches them."""
    return plus_zero(value, graph_zero(*tensors))
