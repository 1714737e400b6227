"""Learning-rate schedules of ``training.lr_schedule``: constant, linear decay and cosine decay, each after a linear
warmup, with the formulas of Hugging Face's schedulers (``get_constant_schedule_with_warmup``,
``get_linear_schedule_with_warmup``, ``get_cosine_with_min_lr_schedule_with_warmup``), so that a run ported from TRL
steps with the same learning rates.

Step ``s`` is the number of optimizer steps taken before it (0 for the first). Its rate is the optimizer's ``lr``
times :func:`multiplier`:

- warmup (``s < warmup_steps``): ``s / warmup_steps`` (the first step of a warmup has rate 0, as in Hugging Face);
- ``constant``: 1;
- ``linear``: ``max(0, (total_steps - s) / (total_steps - warmup_steps))``, down to 0 at ``total_steps``, then
  ``min_lr_ratio`` as the floor;
- ``cosine``: ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))``, ``progress`` going from 0 to
  1 between ``warmup_steps`` and ``total_steps`` and staying 1 after (Hugging Face's cosine rises again past
  ``total_steps``; this one stays at its floor).

:func:`make_scheduler` wraps it in a torch ``LambdaLR`` that DeepSpeed steps after every optimizer step and keeps in
checkpoints (``last_epoch``: the steps taken). Every parameter group follows the same multiplier of its own ``lr``,
also a group added at run time (``create_adapter``, ``load_adapter`` into a new name).
This module decides the rates only; the engine (``hf_backend``) hands the scheduler to DeepSpeed.
"""

from __future__ import annotations

import math


def multiplier(schedule, step: int) -> float:
    """The factor on the optimizer's ``lr`` for optimizer step ``step`` (0-based) under ``schedule``
    (:class:`~llmrl.engine.config.types.LRSchedule`)."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return step / warmup
    if schedule.type == "constant":
        return 1.0
    span = max(1, schedule.total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = schedule.min_lr_ratio
    if schedule.type == "linear":
        return max(floor, 1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer, schedule):
    """A ``LambdaLR`` applying :func:`multiplier` to every group of ``optimizer`` (None without a schedule), including
    groups added or removed after it was made (:func:`fit_new_groups`)."""
    if schedule is None:
        return None
    from torch.optim.lr_scheduler import LambdaLR

    class GroupsSchedule(LambdaLR):
        """Each group's rate is its own base rate (``initial_lr``) times the step's multiplier, for the groups there
        are at each step: a run-time adapter's group joins the schedule (torch's ``LambdaLR`` keeps one entry per
        group it was made with, and raised after the optimizer step once groups were added or removed)."""

        def get_lr(self):
            fit_new_groups(self)
            factor = multiplier(schedule, self.last_epoch)
            return [group["initial_lr"] * factor for group in self.optimizer.param_groups]

    return GroupsSchedule(optimizer, lambda step: multiplier(schedule, step))


def fit_new_groups(scheduler) -> None:
    """Give every parameter group ``scheduler`` has not seen (a LoRA adapter created at run time) its base rate and
    this step's scheduled rate (the optimizer's ``lr`` times the multiplier of the steps taken: a warm-up's too)."""
    if not getattr(scheduler, "lr_lambdas", None):  # no schedule, or one of DeepSpeed's (training.deepspeed)
        return
    factor = scheduler.lr_lambdas[0](max(scheduler.last_epoch, 0))
    for group in scheduler.optimizer.param_groups:
        if "initial_lr" not in group:
            group["initial_lr"] = group["lr"]
            group["lr"] = group["initial_lr"] * factor
