"""The optimizer of a trained LLM: one parameter group per LoRA adapter, and steps that touch only what was trained.

Several adapters share one model and one optimizer. An optimizer steps every parameter of its groups, whatever
its gradient: Adam and SGD with momentum move a weight whose gradient is zero by its stored moments, AdamW decays
it, and under ZeRO 1-3 every parameter of a flat partition is stepped. So training adapter ``a`` would move an
adapter ``b`` trained earlier, and advance its moments and step counts. Here every adapter's parameters form their
own group (tagged ``llmrl_adapter``), everything else trained (heads, unfrozen layers) one shared group, and
:class:`AdapterSteps` restricts each step to the shared group and the groups of the adapters the step trained:
the other adapters' weights, moments and step counts stay bit-identical, as if each adapter had an optimizer of
its own. Every ZeRO stage calls the torch optimizer's ``step`` with the groups it is stepping, so the filter works
at that one point (and so does the copy that lets a step be undone, see
:mod:`llmrl.engine.model.training.finite_steps`). The tag is kept in the optimizer's state dict, so checkpoints
restore it.

This module does not decide which adapters a step trained (:mod:`llmrl.engine.model.training.trainer` does).
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.engine.model.training.own_optimizers import torch_optimizer

ADAPTER_KEY = "llmrl_adapter"


def adapter_of(name: str, adapters: list[str]) -> str | None:
    """The adapter a parameter belongs to, by PEFT's naming: the adapter's name right after a LoRA container
    (``...q_proj.lora_A.<adapter>.weight``, ``lora_magnitude_vector.<adapter>``) or ``modules_to_save``; or None."""
    parts = name.split(".")
    for before, part in zip(parts, parts[1:]):
        if part in adapters and (before.startswith("lora_") or before == "modules_to_save"):
            return part
    return None


def param_groups(module: torch.nn.Module, adapters: list[str]) -> list[dict]:
    """The trainable parameters of ``module`` in groups: the shared ones first (untagged), then one group per
    adapter (tagged with its name); empty groups are left out."""
    shared, by_adapter = [], {name: [] for name in adapters}
    for name, param in module.named_parameters():
        if param.requires_grad:
            owner = adapter_of(name, adapters)
            (shared if owner is None else by_adapter[owner]).append(param)
    groups = [{"params": shared}] if shared else []
    groups += [{"params": params, ADAPTER_KEY: name} for name, params in by_adapter.items() if params]
    return groups


def make_optimizer(module: torch.nn.Module, adapters: list[str], spec) -> torch.optim.Optimizer:
    """The torch optimizer the config names (``training.optimizer``), over :func:`param_groups`."""
    return torch_optimizer(param_groups(module, adapters), spec)


def copy_groups(records: list, optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Append ``(adapter, tensor, copy, copy of its optimizer state)`` for each tensor of ``groups`` to
    ``records`` (before a step, to undo it)."""
    with torch.no_grad():
        for group in groups:
            for p in group["params"]:
                state = {k: v.detach().clone() if torch.is_tensor(v) else v
                         for k, v in optimizer.state.get(p, {}).items()}
                records.append((group.get(ADAPTER_KEY), p, p.detach().clone(), state))


class AdapterSteps:
    """Wraps a torch optimizer's ``step`` so that, inside :meth:`only`, it steps the untagged groups and the groups
    of the named adapters only (outside, every group, as a plain optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.trained: set[str | None] | None = None  # None: every group
        self.record: list | None = None  # where a step copies what it changes (finite_steps.copied_step)
        original = optimizer.step

        def step(*args, **kwargs):
            groups = optimizer.param_groups
            if self.record is not None:
                stepped = [g for g in groups if self.trained is None or g.get(ADAPTER_KEY) in self.trained]
                copy_groups(self.record, optimizer, stepped)
            if self.trained is None:
                return original(*args, **kwargs)
            # DeepSpeed may have narrowed param_groups to the group it is stepping: filter what it hands over.
            optimizer.param_groups = [g for g in groups if g.get(ADAPTER_KEY) in self.trained]
            try:
                return original(*args, **kwargs)
            finally:
                optimizer.param_groups = groups

        if getattr(original, "_wrapped_by_lr_sched", False):  # torch's scheduler counts the steps in ``original``
            step._wrapped_by_lr_sched = True  # (its check would otherwise warn that step was replaced after it)
        optimizer.step = step

    @contextlib.contextmanager
    def only(self, adapters):
        """Steps taken inside touch the shared group and the groups of ``adapters`` (names) only."""
        self.trained = {None, *adapters}
        try:
            yield
        finally:
            self.trained = None
