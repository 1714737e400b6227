"""The global gradient norm of an optimizer step where DeepSpeed records none: ZeRO 0 in float32, whose engine
clips with a norm it then drops, and computes none without clipping (``get_global_grad_norm()`` is None there).

:func:`recorded_norm` wraps one ``engine.step()``: with clipping it keeps the norm DeepSpeed's own clipping
computes (the same call, the same collectives); without, it reads the gradients as the optimizer is about to
step, after the replicas' all-reduce: on one rank's whole weights, or under tensor parallelism with DeepSpeed's
clipping function and an infinite bound (its ranks hold parts of the split weights: it counts the whole ones on one
rank of each group). It changes no gradient. Other layouts are left to DeepSpeed, which records theirs.
"""

from __future__ import annotations

import contextlib

import torch


def _records_its_own(engine) -> bool:
    return bool(engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled())


@contextlib.contextmanager
def recorded_norm(engine):
    """Yields a dict whose ``"norm"`` (a float) is the step's gradient norm before clipping, once the step ran."""
    found: dict = {}
    if _records_its_own(engine) or not isinstance(engine.optimizer, torch.optim.Optimizer):
        yield found
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep():  # DeepSpeed's clip_fp32_gradients, keeping what it returns
        found["norm"] = float(clip_grad_norm_(parameters=engine.module.parameters(),
                                              max_norm=engine.gradient_clipping(), mpu=engine.mpu))

    def before_step(optimizer, args, kwargs):
        if "norm" not in found and engine.autotp_size() > 1:  # DeepSpeed's norm over split and whole weights
            found["norm"] = float(clip_grad_norm_(parameters=engine.module.parameters(), max_norm=float("inf"),
                                                  mpu=engine.mpu))  # (an infinite bound scales by 1)
        if "norm" not in found:
            squares = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters() if p.grad is not None]
            found["norm"] = float(torch.stack(squares).sum().sqrt()) if squares else 0.0

    engine.clip_fp32_gradients = clip_and_keep
    handle = engine.optimizer.register_step_pre_hook(before_step)
    try:
        yield found
    finally:
        handle.remove()
        del engine.clip_fp32_gradients  # the class's method again
