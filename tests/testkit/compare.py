"""What the live tests comparing two LLMs of one run share: their weights after the same updates are equal, and the
updates trained something."""

from __future__ import annotations


def assert_same_training(got: dict, want: dict, start: dict, atol: float, min_moved: int = 4, label: str = "") -> None:
    """``got`` equals ``want`` (state dicts) to ``atol`` on every tensor, and at least ``min_moved`` tensors of
    ``want`` moved from ``start`` by more than 1e-4."""
    import torch

    moved = 0
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m, k=key: f"{label}{k}: {m}")
        moved += int((value - start[key]).abs().max() > 1e-4)
    assert moved >= min_moved, f"{label}only {moved} tensor(s) moved: the updates must train something"
