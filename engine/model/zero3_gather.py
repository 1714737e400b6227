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


@contextlib.contextmanager
def gathered_weights(engine, cap_mb: int):
    """Inside, ``engine.module`` runs with every weight whole and no ZeRO-3 hook; yields whether it gathered (False:
    not ZeRO-3, ``cap_mb`` 0, or the model larger than ``cap_mb``: the per-layer path, untouched). Every rank of the
    group must enter it for the same call (a collective)."""
    offload = _offload(engine)
    params = list(offload.module.parameters()) if offload is not None and cap_mb > 0 else []
    if not params or gathered_bytes(params) > cap_mb * 2**20:
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        for param in params:  # nothing is in flight between calls; cleared as DeepSpeed's users do
            param.ds_active_sub_modules.clear()
        engine.llmrl_gathered_calls = getattr(engine, "llmrl_gathered_calls", 0) + 1  # server_memory reports it
        try:
            with _without_hooks(offload.module, [*offload.forward_hooks, *offload.backward_hooks]), _plain_linear():
                yield True
        finally:  # the next hooked forward records its prefetch trace anew, as after DeepSpeed's own re-registration
            coordinator = offload.get_param_coordinator()
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _without_hooks(module: torch.nn.Module, handles: list):
    """Inside, the hooks of ``handles`` (DeepSpeed's, on ``module``'s submodules) are removed; after, even on an
    error, they are back in their places, in their order, among whatever hooks the modules hold by then. This puts
    back the very functions DeepSpeed registered, with the same handles, instead of registering them anew (which
    walked the module tree: 80 ms a call for SmolLM2-135M on CPU, most of the gathered call's overhead)."""
    ours = {handle.id for handle in handles}
    saved = [(hooks, list(hooks.items())) for hooks in _dicts_holding(module, handles, ours)]
    for handle in handles:
        handle.remove()
    try:
        yield
    finally:
        for hooks, before in saved:
            now = dict(hooks)  # hooks others added or kept meanwhile stay; ours come back
            hooks.clear()
            hooks.update((key, now.get(key, fn)) for key, fn in before if key in now or key in ours)
            hooks.update((key, fn) for key, fn in now.items() if key not in hooks)


def _dicts_holding(module: torch.nn.Module, handles: list, ours: set) -> list[dict]:
    """The hook dicts that hold any of ``handles``. torch's handles keep weak references to the dicts they were
    registered in, so those are read from the handles (a 135M model's ~4,000 hook dicts are not walked at every
    call); a handle without them makes this walk ``module``'s submodules instead."""
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
