"""Tiny collectives over an LLM group's control channel (a gloo group, CPU tensors).

Used to keep the ranks of one LLM in step: agree that every rank is healthy before a collective
training step (``all_ok``), and agree on how many forward calls a ZeRO-3 request needs (``max_int``).
With a group of one rank they return at once.

This module does not know about models; it moves one integer.
"""

from __future__ import annotations

import torch


def _reduce(value: int, group, op) -> int:
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def all_ok(ok: bool, group) -> bool:
    """True when every rank of the group passed ``ok=True``."""
    import torch.distributed as dist

    return bool(_reduce(1 if ok else 0, group, dist.ReduceOp.MIN))


def max_int(value: int, group) -> int:
    import torch.distributed as dist

    return _reduce(value, group, dist.ReduceOp.MAX)
