"""Float16 loss scaling for the weights that step outside DeepSpeed's optimizer (the own optimizers of adapters
created at run time, :mod:`llmrl.engine.model.training.own_optimizers`).

In float16 DeepSpeed multiplies each backward pass's loss by its loss scale (at ZeRO 0 llmrl does, as DeepSpeed's
float16 optimizer there expects: :func:`backward_factor`), so every gradient the pass leaves, on
DeepSpeed's parameters and on the others alike, is that many times the true one; DeepSpeed divides its own by the
scale at its step, skips a step whose gradients overflowed and lowers the scale (its dynamic loss scaler). The
own optimizers divide by the same scale (:func:`loss_scale`), skip the step of an adapter whose gradients
overflowed, lower the scale when DeepSpeed did not (it checks its own parameters only), and grow it after a window of
steps without overflow where only they stepped (:func:`after_own_step`).
Gradients still pending when the scale changes are brought to the new one (:func:`rescale`), so each gradient always
carries the current scale.

This module does not decide when to step (the trainer does); without float16 every scale here is 1.
"""

from __future__ import annotations

import torch


def loss_scale(engine) -> float:
    """The scale of the loss of the engine's backward passes: DeepSpeed's current float16 loss scale, or 1."""
    if not engine.fp16_enabled():
        return 1.0
    return float(engine.optimizer.loss_scale)


def backward_factor(engine) -> float:
    """What to multiply a loss by before ``engine.backward``: the loss scale for DeepSpeed's float16 optimizer at
    ZeRO 0, 1 elsewhere. DeepSpeed 0.19's ``engine.backward`` scales the loss of its ZeRO optimizers only, while its
    float16 optimizer at ZeRO 0 divides every gradient by the scale at its step (measured: a step of SGD moved a
    weight 1/256 of the way at a scale of 256)."""
    if engine.fp16_enabled() and not engine.zero_optimization():
        return loss_scale(engine)
    return 1.0


def unscaled_norm(engine, norm: float | None, scale: float) -> float | None:
    """The gradient norm DeepSpeed reports for a step (``norm``), without the loss ``scale`` of its gradients:
    DeepSpeed's float16 optimizer for torch optimizers at ZeRO 0 (``FP16_UnfusedOptimizer``) reports the norm of the
    scaled gradients (it divides by the scale where it clips), the others the norm of the true ones."""
    if norm is None or not engine.fp16_enabled() or engine.zero_optimization():
        return norm
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return norm / scale if isinstance(engine.optimizer, FP16_UnfusedOptimizer) else norm


def after_own_step(engine, run_time, overflow: bool) -> None:
    """DeepSpeed's dynamic loss scaling, for a step of the own optimizers that DeepSpeed did not see: after an
    overflow the scale is halved (not below the config's ``fp16.min_loss_scale``); after ``fp16.loss_scale_window``
    own steps in a row without one, alone (DeepSpeed grows the scale after its own steps), it doubles. A static scale
    (``fp16.loss_scale`` > 0) stays. ``run_time``: the LLM's :class:`~llmrl.engine.model.served_state.RunTimeAdapters`
    (its count of steps since the last overflow)."""
    if not engine.fp16_enabled() or not engine.dynamic_loss_scale():
        return
    args = engine.dynamic_loss_scale_args()
    if overflow:
        engine.optimizer.loss_scale = max(loss_scale(engine) / 2, float(args["min_scale"]))
        run_time.steps_without_overflow = 0
        return
    run_time.steps_without_overflow += 1
    if run_time.steps_without_overflow % int(args["scale_window"]) == 0:
        engine.optimizer.loss_scale = loss_scale(engine) * 2


def rescale(grads, factor: float) -> None:
    """Multiply each gradient tensor in ``grads`` by ``factor`` in place (nothing when it is 1)."""
    if factor != 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(factor)
