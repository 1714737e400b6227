"""``training.lr_schedule`` against Hugging Face's own schedulers (the independent reference), step by step, and the
config's checks. (Live: ``test_checkpoint_live`` resumes a cosine schedule from a checkpoint.)"""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import LRSchedule
from llmrl.engine.model.training.lr_schedule import make_scheduler


def rates(make, steps: int = 14, lr: float = 0.5) -> list[float]:
    """The learning rates of each of ``steps`` optimizer steps (its two groups', in turn) under the scheduler
    ``make(optimizer)`` builds."""
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr / 2}],
                                lr=lr)
    scheduler = make(optimizer)
    out = []
    for _ in range(steps):
        out += [group["lr"] for group in optimizer.param_groups]
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedules_step_as_hugging_face_s(warmup):
    import transformers

    cases = [
        (LRSchedule("constant", warmup), lambda o: transformers.get_constant_schedule_with_warmup(o, warmup)),
        (LRSchedule("linear", warmup, 10), lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, 10)),
        (LRSchedule("cosine", warmup, 10), lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, 10)),
        (LRSchedule("cosine", warmup, 10, 0.2), lambda o: transformers.get_cosine_with_min_lr_schedule_with_warmup(
            o, warmup, 10, min_lr_rate=0.2)),
    ]
    for schedule, reference in cases:  # up to total_steps (after it, Hugging Face's cosine rises again; ours stays)
        got, want = rates(lambda o, s=schedule: make_scheduler(o, s), 11), rates(reference, 11)
        assert got == pytest.approx(want, abs=1e-12), schedule
    after = rates(lambda o: make_scheduler(o, LRSchedule("cosine", warmup, 10, 0.2)), 14)[22:]
    assert after == pytest.approx([0.1, 0.05] * 3, abs=1e-12)  # the floor: min_lr_ratio x each group's lr
    linear = rates(lambda o: make_scheduler(o, LRSchedule("linear", 2, 6)))
    assert linear[0:16:2] == pytest.approx([0.0, 0.25, 0.5, 0.375, 0.25, 0.125, 0.0, 0.0])
    assert linear[1::2] == pytest.approx([x / 2 for x in linear[0::2]])  # every group: the same factor of its lr


def test_schedules_are_checked_with_the_config(tiny):
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError

    base = {"llms": {"main": {"model": tiny["llama"], "updater": "ppo"}}}
    config = load_config(raw=base, overrides=["llms.main.training.lr_schedule.type=linear",
                                              "llms.main.training.lr_schedule.total_steps=100"])
    assert config.llms["main"].training.lr_schedule == LRSchedule("linear", 0, 100, 0.0)
    with pytest.raises(ConfigError, match=r"lr_schedule.total_steps: a cosine schedule decays until total_steps, "
                                          r"which must exceed warmup_steps \(5\); got 5"):
        load_config(raw=base, overrides=["llms.main.training.lr_schedule={type: cosine, warmup_steps: 5, "
                                         "total_steps: 5}"])
    with pytest.raises(ConfigError, match="lr_schedule.type"):
        load_config(raw=base, overrides=["llms.main.training.lr_schedule.type=step"])


def test_the_adapter_steps_wrapper_keeps_the_scheduler_quiet():
    """The scheduler is made before :class:`AdapterSteps` wraps ``step`` (DeepSpeed gets both); torch's scheduler
    must still see its own wrapper, or it warns at its first step that ``optimizer.step()`` was overridden."""
    import warnings

    from llmrl.engine.model.training.optimizer import AdapterSteps

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scheduler = make_scheduler(optimizer, LRSchedule("linear", 0, 4))
    AdapterSteps(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            weight.grad = torch.ones(2)
            optimizer.step()
            scheduler.step()
    assert weight.tolist() == [1 - 0.5 - 0.375] * 2  # the rates 0.5, then 0.5 x 3/4


@pytest.mark.parametrize("script_lr", [None, 0.1])
def test_optim_step_settings_leave_the_schedule_stepping(script_lr):
    """``optim_step`` sets the script's hyperparameters around the engine's step, which steps the optimizer and then
    the scheduler: the schedule advances as under ``update`` (a warm-up held at its first rate, 0, trained nothing),
    and the script's learning rate, when given, is the step's own; other settings come back after the step."""
    import types

    import transformers

    from llmrl.engine.model.training.client_steps import step_settings

    def engine_steps(optimizer, scheduler, settings):
        served = types.SimpleNamespace(adapter_steps=types.SimpleNamespace(optimizer=optimizer),
                                       engine=types.SimpleNamespace(optimizer=optimizer, lr_scheduler=scheduler,
                                                                    _config=types.SimpleNamespace(gradient_clipping=0)))
        used = []
        for _ in range(6):
            with step_settings(served, settings):
                used.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]))
                optimizer.step()  # what DeepSpeed's engine.step does: the optimizer, then the scheduler
                scheduler.step()
            assert optimizer.param_groups[0]["weight_decay"] == 0.0  # the config's value is back
        return used, optimizer.param_groups[0]["lr"]

    def make(schedule_of):
        weight = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([weight], lr=0.5, weight_decay=0.0)
        return optimizer, schedule_of(optimizer)

    settings = {"weight_decay": 0.01, **({} if script_lr is None else {"learning_rate": script_lr})}
    ours, left = engine_steps(*make(lambda o: make_scheduler(o, LRSchedule("constant", 3))), settings)
    reference = rates(lambda o: transformers.get_constant_schedule_with_warmup(o, 3), steps=7)[::2]
    expected = [script_lr if script_lr is not None else rate for rate in reference[:6]]
    assert [lr for lr, _ in ours] == pytest.approx(expected)
    assert left == pytest.approx(reference[6])  # the schedule's rate for the next step (an update's, say)
    assert all(decay == 0.01 for _, decay in ours)


def test_a_scripts_rate_equal_to_the_schedules_next_one_does_not_bring_back_the_rate_before_it():
    """Warm-up of 2 steps to 0.5: the script gives 0.5 at step 1, which is also the schedule's rate for step 2. The
    rate before step 1 (0.25) used to come back for step 2, since an unchanged rate read as "no scheduler step"."""
    import types

    from llmrl.engine.model.training.client_steps import step_settings

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    scheduler = make_scheduler(optimizer, LRSchedule("constant", 2))
    served = types.SimpleNamespace(adapter_steps=types.SimpleNamespace(optimizer=optimizer),
                                   engine=types.SimpleNamespace(optimizer=optimizer, lr_scheduler=scheduler,
                                                                _config=types.SimpleNamespace(gradient_clipping=0)))
    used = []
    for settings in ({}, {"learning_rate": 0.5}, {}, {"learning_rate": 0.1}, {}):
        with step_settings(served, settings):
            used.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert used == pytest.approx([0.0, 0.5, 0.5, 0.1, 0.5])


def test_groups_added_and_removed_at_run_time_follow_the_schedule():
    """A run-time adapter adds an optimizer group mid-schedule (create_adapter) and may delete it: every group present
    steps at its own rate times the step's multiplier, a new one from its first step (torch's LambdaLR raised after
    the optimizer step once the groups changed, and gave a new group the full rate during a warm-up)."""
    from llmrl.engine.model.training.lr_schedule import fit_new_groups, multiplier

    schedule = LRSchedule("linear", 4, 10)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    scheduler = make_scheduler(optimizer, schedule)
    seen = []
    for step in range(8):
        if step == 2:
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2})
            fit_new_groups(scheduler)
        if step == 5:
            del optimizer.param_groups[0]
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    expected = [[0.5 * multiplier(schedule, s)] + ([0.2 * multiplier(schedule, s)] if s >= 2 else []) for s in range(5)]
    expected += [[0.2 * multiplier(schedule, s)] for s in range(5, 8)]
    assert seen == [pytest.approx(rates) for rates in expected]
    assert multiplier(schedule, 2) == 0.5  # the new group started inside the warm-up, at half its rate
