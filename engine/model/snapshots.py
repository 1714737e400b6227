"""Named weight snapshots on a server rank: a frozen copy of a LoRA adapter's weights (or, for a model trained
without LoRA, of every trained weight), read like an adapter.

``snapshot(name)`` adds a PEFT adapter ``name`` with the source adapter's configuration and a copy of its weights
(same dtype, same device), never trained: it is in no optimizer group and its parameters do not require
gradients. ``generate``, ``score``, ``forward`` and ``custom_module_fns`` read it with ``peft_adapter=name`` while
the source goes on training: the policy that sampled a batch, a reference policy, a DPO reference. Taking a
snapshot under a name that exists overwrites it (the same configuration: the weights are copied in place).
``drop_snapshot`` deletes it. Either way, the cache across calls forgets the keys and values it held under that
name, so that a read never meets keys computed with other weights.

A model trained without LoRA gets a weight snapshot: a copy of every trained parameter (the model's and the
heads'), which :meth:`ServedModel.adapter` swaps in (tensor pointers, no copy) for the reads that name it, and back.
Under ZeRO-3 a LoRA snapshot is whole on every rank (a configured adapter's partitioned weights are gathered to copy
them), and a weight snapshot holds each rank's partitions (:mod:`llmrl.engine.model.partitioned_snapshots`).
Snapshots are saved with the
checkpoint and taken again on resume (:mod:`llmrl.engine.model.checkpoint`). Their count and bytes are capped with
those of adapters created at run time (:mod:`llmrl.engine.model.adapter_caps`). This module does not decide when to
snapshot; the script does. A snapshot's policy version is its source's when it was taken
(:mod:`llmrl.engine.model.version_counts`).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from llmrl.engine.adapter_names import name_problem
from llmrl.engine.model.adapter_caps import check_room
from llmrl.engine.model.partitioned_snapshots import copy_held, held_bytes
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.tp_lora import split_new_adapter
from llmrl.engine.model.version_counts import copy_version, forget_version
from llmrl.engine.model.zero3_gather import gathered_bytes


def check_adapter_name(name, what: str) -> None:
    """Refuse a name that breaks llmrl's rule (:mod:`llmrl.engine.adapter_names`: names PEFT treats specially)."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(f"{what}'s name {name!r} is refused by llmrl's rule for adapter names: it {problem}")


def uses_lora(served: ServedModel) -> bool:
    return hasattr(served.model, "peft_config") and bool(served.adapters)


def check_can_snapshot(served: ServedModel, name: str, source: str | None) -> str | None:
    """The adapter to copy (None: the trained weights of a model without LoRA); raises ValueError naming what
    prevents the snapshot."""
    llm = served.llm.name
    check_adapter_name(name, "a snapshot")
    if name in served.adapters:
        raise ValueError(f"{name!r} is a trained adapter of LLM {llm!r}; give the snapshot another name")
    if not uses_lora(served):
        if source is not None:
            raise ValueError(f"LLM {llm!r} has no LoRA adapter: a snapshot copies its trained weights; leave "
                             "peft_adapter out")
        return None
    source = source or served.active_adapter()
    served.check_adapter(source)
    return source


@contextlib.contextmanager
def flags_kept(model):
    """Inside, PEFT may switch adapters' ``requires_grad``; every parameter that existed gets its flag back."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def parameters_changed(served: ServedModel) -> None:
    """Tell the DeepSpeed engine the module's parameters changed: it names parameters (frozen ones included) in
    checkpoints from a map it builds once."""
    served.engine.param_names = {p: name for name, p in served.engine.module.named_parameters()}
    if served.llm.training.zero_stage == 3:
        from llmrl.engine.model.zero3_state import release_partitioned_only

        release_partitioned_only(served.engine)


def adapter_params(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one LoRA adapter (PEFT names them ``...q_proj.lora_A.<adapter>.weight``: the adapter's name
    right after a ``lora_`` container), keyed by their names with the adapter's name taken out."""
    return {key: p for name, p in model.named_parameters() if (key := without_adapter(name, adapter)) is not None}


def without_adapter(name: str, adapter: str) -> str | None:
    """``name`` without the adapter's part when it names one of ``adapter``'s LoRA weights, else None."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        if parts[k] == adapter and parts[k - 1].startswith("lora_"):
            return ".".join(parts[:k] + parts[k + 1:])
    return None


def take_snapshot(served: ServedModel, name: str, source: str | None, prefix_cache=None) -> dict:
    """Freeze a copy of adapter ``source`` (default: the active one) under ``name``; without LoRA, of every trained
    weight (the model's and the heads')."""
    source = check_can_snapshot(served, name, source)
    if source is None:
        return take_weight_snapshot(served, name, prefix_cache)
    model = served.model
    adapter = served.run_time.snapshots.get(source, source)  # a snapshot of a snapshot: the same adapter's config
    if name not in served.run_time.snapshots:  # a new one (taken again, a snapshot keeps its place)
        check_room(served, "snapshot", name)
        check_room(served, "snapshot", name, gathered_bytes(adapter_params(model, source).values()))  # ZeRO-3: whole
    originals = whole_copies(adapter_params(model, source))  # the named weights
    if name in served.run_time.snapshots and served.run_time.snapshots[name] != adapter:
        drop_snapshot(served, name, prefix_cache)
    if name not in served.run_time.snapshots:
        with flags_kept(model):
            model.add_adapter(name, copy.deepcopy(model.peft_config[adapter]))
        split_new_adapter(model, name)  # tensor parallelism: the parts of this rank (llmrl.engine.model.tp_lora)
    copies = adapter_params(model, name)
    if copies.keys() != originals.keys():
        with flags_kept(model):
            model.delete_adapter(name)
        served.run_time.snapshots.pop(name, None)
        raise RuntimeError(f"snapshot {name!r} does not mirror adapter {source!r}: parameters differ")
    for key, p in copies.items():
        p.data = originals[key]
        p.requires_grad_(False)
    served.run_time.snapshots[name] = adapter
    copy_version(served, name, source)
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"snapshot": name, "source": source, "bytes": snapshot_bytes(served, name)}


def whole_copies(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of each of ``params``, whole: ZeRO-3's partitioned weights (a configured adapter's) are gathered
    first (collective: every rank of the LLM copies the same weights)."""
    parts = [p for p in params.values() if hasattr(p, "ds_id")]
    if not parts:
        return {key: p.detach().clone() for key, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(parts):
        return {key: p.detach().clone() for key, p in params.items()}


def take_weight_snapshot(served: ServedModel, name: str, prefix_cache=None) -> dict:
    """A frozen copy of every trained parameter, swapped in by :meth:`ServedModel.adapter` for reads."""
    trained = {n: p for n, p in served.module.named_parameters() if p.requires_grad}
    if not trained:
        raise ValueError(f"LLM {served.llm.name!r} has no trained weight to snapshot")
    if name not in served.run_time.weight_snapshots:
        check_room(served, "snapshot", name)
        check_room(served, "snapshot", name, sum(held_bytes(p) for p in trained.values()))
    weights = copy_held(trained)  # under ZeRO-3, this rank's partitions
    served.run_time.weight_snapshots[name] = weights
    copy_version(served, name, None)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"snapshot": name, "source": None, "bytes": snapshot_bytes(served, name)}


def drop_snapshot(served: ServedModel, name: str, prefix_cache=None) -> dict:
    if name in served.run_time.weight_snapshots:
        del served.run_time.weight_snapshots[name]
        forget_version(served, name)
        if prefix_cache is not None:
            prefix_cache.forget(name)
        return {"dropped": name}
    if name not in served.run_time.snapshots:
        known = sorted([*served.run_time.snapshots, *served.run_time.weight_snapshots])
        raise ValueError(f"LLM {served.llm.name!r} has no snapshot {name!r}; snapshots: "
                         f"{', '.join(known) or 'none'}")
    with flags_kept(served.model):
        served.model.delete_adapter(name)
    del served.run_time.snapshots[name]
    forget_version(served, name)
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"dropped": name}


def snapshot_bytes(served: ServedModel, name: str) -> int:
    tensors = served.run_time.weight_snapshots.get(name) or adapter_params(served.model, name)
    return sum(p.numel() * p.element_size() for p in tensors.values())


def snapshots_report(served: ServedModel) -> dict:
    """Every snapshot: the adapter it copies (None: the trained weights) and its bytes (for ``server_memory``)."""
    names = {**served.run_time.snapshots, **{name: None for name in served.run_time.weight_snapshots}}
    return {name: {"source": source, "bytes": snapshot_bytes(served, name)} for name, source in sorted(names.items())}
