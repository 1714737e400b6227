"""ZeRO-3 weights gathered once per inference call, instead of layer by layer at every forward.

Under ZeRO-3 each rank holds a shard of every weight; DeepSpeed's hooks gather a submodule's weights before its
forward and free them after, at every model call: in a decoding loop, every layer at every new token. For a call
that computes no gradient (``score``, ``generate``, an update's gradient-free passes), :func:`gathered_weights`
gathers every weight once (``deepspeed.zero.GatheredParameters``, a collective every rank of the LLM's group enters
once per call, as each takes part in every call), removes the hooks for the call's duration, so that the model runs
as a plain module (with torch's own ``linear``, which ZeRO-3 replaces process-wide), and puts them back after, even
when the call fails (DeepSpeed's own ``unwrap_model_for_generation`` and TRL's do the same, without the
``finally``). The weights are then freed (nothing was modified: no broadcast). Results are those of the per-layer
path: the same weights, the same code. ``server_memory()`` reports, per rank, how many calls gathered
(``zero3_gathered_calls``).

A model whose gathered weights exceed ``training.zero3_gather_mb`` on each rank keeps the per-layer path (the full
model must fit beside the shards). This module runs no request; it does not gather for training passes, whose
backward needs DeepSpeed's hooks.
"""

from __future__ import annotations

import contextlib

import torch


def _offload(engine):
    """DeepSpeed's ZeRO-3 parameter-offload object holding the module hooks, or None (not ZeRO-3)."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if offload is not None and hasattr(offload, "forward_hooks") else None


def gathered_bytes(params) -> int:
    """The bytes ``params`` take once gathered (their full size on one rank)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)


def gathers_whole(engine, cap_mb: int) -> bool:
    """Whether a call's weights are whole on this rank: not partitioned, or gathered for the call by
    :func:`gathered_weights` (the model within ``cap_mb``). Computes no collective."""
    offload = _offload(engine)
    if offload is None:
        return True
    plan = _call_plan(offload.module, [*offload.forward_hooks, *offload.backward_hooks])
    return not plan.params or (cap_mb > 0 and plan.gathered_bytes <= cap_mb * 2**20)


@contextlib.contextmanager
def gathered_weights(engine, cap_mb: int):
    """Inside, ``engine.module`` runs with every weight whole and no ZeRO-3 hook; yields whether it gathered (False:
    not ZeRO-3, ``cap_mb`` 0, or the model larger than ``cap_mb``: the per-layer path, untouched). Every rank of the
    group must enter it for the same call (a collective)."""
    offload = _offload(engine)
    if offload is None or cap_mb <= 0:
        yield False
        return
    plan = _call_plan(offload.module, [*offload.forward_hooks, *offload.backward_hooks])
    if not plan.params or plan.gathered_bytes > cap_mb * 2**20:
        yield False
        return
    with _own_shards(plan.params) if plan.own_shards else _deepspeed_gather(plan.params):
        for param in plan.params:  # nothing is in flight between calls; cleared as DeepSpeed's users do
            param.ds_active_sub_modules.clear()
        engine.llmrl_gathered_calls = getattr(engine, "llmrl_gathered_calls", 0) + 1  # server_memory reports it
        try:
            with _without_hooks(plan), _plain_linear():
                yield True
        finally:  # the next hooked forward records its prefetch trace anew, as after DeepSpeed's own re-registration
            coordinator = offload.get_param_coordinator()
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


class _CallPlan:
    """What every gathered call of one model needs, found once: its weights, their gathered size, whether each is
    its own rank's whole shard, and the hook dicts that hold DeepSpeed's hooks. Under ZeRO-3 the partitioned
    weights and their hooks are fixed when the engine is built (adapters and snapshots added later are whole on
    every rank, and not gathered: :mod:`llmrl.engine.model.zero3_state`); the plan is made again if DeepSpeed's
    hooks change (``hooks``: their handles' ids)."""

    def __init__(self, module: torch.nn.Module, handles: list):
        self.hooks = frozenset(handle.id for handle in handles)
        self.params = [p for p in module.parameters() if hasattr(p, "ds_id")]  # the partitioned ones
        self.gathered_bytes = gathered_bytes(self.params)
        self.own_shards = bool(self.params) and all(_is_own_shard(param) for param in self.params)
        self.hook_dicts = _dicts_holding(module, handles, self.hooks)


def _call_plan(module: torch.nn.Module, handles: list) -> _CallPlan:
    """The plan kept on ``module`` for DeepSpeed's hooks ``handles`` (walking a 2,000-module model's weights and
    8,000 hooks at every call took 5 ms on CPU)."""
    plan = module.__dict__.get("_llmrl_zero3_plan")
    if plan is None or plan.hooks != frozenset(handle.id for handle in handles):
        plan = module.__dict__["_llmrl_zero3_plan"] = _CallPlan(module, handles)
    return plan


def _is_own_shard(param) -> bool:
    """Whether ``param``'s shard on this rank is the whole weight, on the device it runs on: a group of one rank,
    without ZeRO++'s secondary shards, quantized weights or offloaded partitions."""
    import torch.distributed as dist

    shard = getattr(param, "ds_tensor", None)
    return (shard is not None and getattr(param, "ds_secondary_tensor", None) is None
            and not hasattr(shard, "ds_quant_scale") and shard.device == param.device
            and shard.numel() == param.ds_numel and getattr(shard, "final_location", None) is None
            and dist.get_world_size(group=param.ds_process_group) == 1)


@contextlib.contextmanager
def _deepspeed_gather(params: list):
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


@contextlib.contextmanager
def _own_shards(params: list):
    """Inside, each weight is a view of its own shard (a group of one rank holds every weight whole): what
    DeepSpeed's gather does for such a group, without its per-weight bookkeeping, which took 11 ms a call on CPU
    for 554 weights. Nothing is copied, and nothing freed after (the shard holds the memory). As in DeepSpeed's
    gather, a weight already available (DeepSpeed keeps small weights whole after an optimizer step) is used as it
    is, and every weight is partitioned after the call, even when the call fails."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in params:
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            raise RuntimeError(f"ZeRO-3 weight {param.ds_id} is being gathered between calls")
    try:
        for param in params:
            if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                param.data = param.ds_tensor.data.view(param.ds_shape)
                param.ds_status = ZeroParamStatus.AVAILABLE
        yield
    finally:
        for param in params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _without_hooks(plan: _CallPlan):
    """Inside, the hooks of ``plan`` (DeepSpeed's, on its module's submodules) are removed; after, even on an
    error, they are back in their places, in their order, among whatever hooks the modules hold by then. This puts
    back the very functions DeepSpeed registered, with the same handles, instead of registering them anew (which
    walked the module tree: 80 ms a call for SmolLM2-135M on CPU, most of the gathered call's overhead).

    Each hook dict is copied and cleared whole, not emptied handle by handle: with LoRA on every linear layer of a
    24-layer model, DeepSpeed holds 8,004 hooks in 4,002 dicts, and removing them one by one and rebuilding the
    dicts took 30 ms a call on CPU. A dict that holds other hooks too keeps those inside, in their order."""
    ours, dicts = plan.hooks, plan.hook_dicts
    saved = [hooks.copy() for hooks in dicts]
    only_ours = [ours.issuperset(before) for before in saved]
    for hooks, before, alone in zip(dicts, saved, only_ours):
        hooks.clear()
        if not alone:
            hooks.update((key, fn) for key, fn in before.items() if key not in ours)
    try:
        yield
    finally:
        for hooks, before, alone in zip(dicts, saved, only_ours):
            if alone and not hooks:  # nothing was added meanwhile: the dict as it was
                hooks.update(before)
                continue
            now = hooks.copy()  # hooks others added or kept meanwhile stay; ours come back
            hooks.clear()
            hooks.update((key, now.get(key, fn)) for key, fn in before.items() if key in now or key in ours)
            hooks.update((key, fn) for key, fn in now.items() if key not in hooks)


def _dicts_holding(module: torch.nn.Module, handles: list, ours: frozenset) -> list[dict]:
    """The hook dicts that hold any of ``handles``. torch's handles keep weak references to the dicts they were
    registered in, so those are read from the handles (a 135M model's ~4,000 hook dicts are not walked); a handle
    without them makes this walk ``module``'s submodules instead."""
    found: dict[int, dict] = {}
    for handle in handles:
        refs = getattr(handle, "hooks_dict_ref", None), *getattr(handle, "extra_dict_ref", ())
        if refs[0] is None:
            return [hooks for m in module.modules() for name in _HOOK_DICTS
                    if (hooks := getattr(m, name, None)) and any(key in ours for key in hooks)]
        for ref in refs:
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                found[id(hooks)] = hooks
    return list(found.values())


@contextlib.contextmanager
def _plain_linear():
    """``torch.nn.functional.linear`` as torch defines it, inside. ZeRO-3 replaces it process-wide (its
    ``memory_efficient_linear``: an autograd function that keeps the partitioned weight for the backward); with
    whole weights and no backward that only costs time (a third of a decoding step's, measured on CPU), and the
    results are the same."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    original, patched = getattr(Patcher, "linear_bk", None), torch.nn.functional.linear
    if original is None or patched is original:
        yield
        return
    torch.nn.functional.linear = original
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


def clear_zero3_gradients(engine) -> None:
    """Zero ZeRO-3's gradient partitions after an optimizer step. DeepSpeed copies a weight's gradient into its
    partition at the first backward of a step and adds later ones to it: a weight that first gets a gradient in a
    later backward (adapter b trained in the second micro-step, a head used only there) would add it to what the
    previous step left, and train on that silently. Zeroed, every gradient adds up from zero."""
    buffer = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None:
        buffer.zero_()
