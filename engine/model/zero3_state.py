"""The whole state dict of a ZeRO-3 model that also holds whole (unpartitioned) parameters.

Under ZeRO-3 the weights the engine was built with are partitioned across the LLM's ranks; the LoRA adapters and
snapshots created at run time are added later, outside DeepSpeed, and every rank holds them whole (they are small,
and each rank computes their gradients and steps them itself: :mod:`llmrl.engine.model.training.own_optimizers`).
DeepSpeed's own consolidation (``engine._zero3_consolidated_16bit_state_dict``) is written for partitioned
parameters only (it starts by releasing every parameter, which fails on a whole one, and keys weights by their
``ds_id``); :func:`zero3_state_dict` gathers the partitioned ones module by module, as it does, and reads the whole
ones as they are.

Under tensor parallelism too, each layer AutoTP split is gathered from the ranks of its group after its partitions
(as DeepSpeed's consolidation does); adapters stay whole on every rank (:mod:`llmrl.engine.model.tp_lora`). This
module does not save anything (:mod:`llmrl.engine.model.checkpoint` does).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch


def partitioned(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitions ``param`` (DeepSpeed marks its parameters with a ``ds_id``)."""
    return hasattr(param, "ds_id")


def release_partitioned_only(engine) -> None:
    """Make DeepSpeed's release of every parameter skip the whole ones (idempotent; nothing without ZeRO-3).

    Before each optimizer step and checkpoint, ZeRO-3 releases every parameter of the module
    (``partition_all_parameters``), reading DeepSpeed's bookkeeping on each (``ds_active_sub_modules``,
    ``ds_status``), which a parameter added after the engine was built lacks. The engine's offload object gets a
    ``partition_all_parameters`` of its own that hides the whole parameters from their modules while DeepSpeed's
    runs, and puts them back, in their places, after it (even when it fails)."""
    from llmrl.engine.model.zero3_gather import _offload

    offload = _offload(engine)
    if offload is None or getattr(offload, "llmrl_partitioned_only", False):
        return
    release_all = offload.partition_all_parameters

    def partition_all_parameters():
        with whole_hidden(engine.module):
            release_all()

    offload.partition_all_parameters = partition_all_parameters
    offload.llmrl_partitioned_only = True


def release_all(engine) -> None:
    """Free every gathered ZeRO-3 weight (DeepSpeed's release, which waits for gathers in flight; the whole
    parameters passed over); nothing without ZeRO-3."""
    from llmrl.engine.model.zero3_gather import _offload

    offload = _offload(engine)
    if offload is not None:
        release_partitioned_only(engine)
        offload.partition_all_parameters()


@contextlib.contextmanager
def whole_hidden(module: torch.nn.Module):
    """Inside, the whole (unpartitioned) parameters are out of their modules' parameter dicts."""
    saved = []
    for mod in module.modules():
        if any(p is not None and not partitioned(p) for p in mod._parameters.values()):
            saved.append((mod, list(mod._parameters.items())))
            for key, p in saved[-1][1]:
                if p is not None and not partitioned(p):
                    del mod._parameters[key]
    try:
        yield
    finally:
        for mod, items in saved:
            mod._parameters.clear()
            for key, p in items:
                mod._parameters[key] = p


def zero3_state_dict(module: torch.nn.Module, leader: bool, tensor_parallel: bool = False
                     ) -> dict[str, torch.Tensor] | None:
    """``module``'s state dict, weights whole and on the CPU, on the ``leader`` (None elsewhere); with
    ``tensor_parallel``, the split layers' shards gathered too.

    Collective: every rank of the LLM calls it, in the same order of modules (each module's partitioned weights are
    gathered in turn, so no more than one module's weights are whole at once)."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    state: dict[str, torch.Tensor] | None = OrderedDict() if leader else None
    shared: dict[int, str] = {}

    def visit(mod: torch.nn.Module, prefix: str) -> None:
        params = [p for p in mod.parameters(recurse=False) if partitioned(p)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None), \
                GatherReplacedLayerParams(params, mod, enabled=tensor_parallel and bool(params)):
            if state is not None:
                for name, param in mod.named_parameters(recurse=False):
                    if param is None:
                        continue
                    key = prefix + name
                    if partitioned(param) and param.ds_id in shared:  # a tied weight: the same tensor
                        state[key] = state[shared[param.ds_id]]
                        continue
                    state[key] = param.detach().to("cpu", copy=True)
                    if partitioned(param):
                        shared[param.ds_id] = key
                for name, buf in mod.named_buffers(recurse=False):
                    if buf is not None and name not in mod._non_persistent_buffers_set:
                        state[prefix + name] = buf.detach().to("cpu", copy=True)
        for name, child in mod.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return state
