"""Named weight snapshots on a server rank: a frozen copy of a LoRA adapter's weights, read like an adapter.

``snapshot(name)`` adds a PEFT adapter ``name`` with the source adapter's configuration and a copy of its weights
(same dtype, same device), never trained: it is in no optimizer group and its parameters do not require
gradients. ``generate``, ``score``, ``forward`` and ``custom_module_fns`` read it with ``peft_adapter=name`` while
the source goes on training: the policy that sampled a batch, a reference policy, a DPO reference. Taking a
snapshot under a name that exists overwrites it (the same configuration: the weights are copied in place).
``drop_snapshot`` deletes it. Either way, the cache across calls forgets the keys and values it held under that
name, so that a read never meets keys computed with other weights.

Snapshots are of LoRA adapters, with ZeRO 0-2 (ZeRO-3 partitions every parameter when the engine is built, and a
parameter added later would not be); they are saved with the checkpoint and taken again on resume
(:mod:`llmrl.engine.model.checkpoint`). This module does not decide when to snapshot; the script does.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from llmrl.engine.model.served import ServedModel


def check_can_snapshot(served: ServedModel, name: str, source: str | None) -> str:
    """The adapter to copy; raises ValueError naming what prevents the snapshot."""
    llm = served.llm.name
    if not hasattr(served.model, "peft_config") or not served.adapters:
        raise ValueError(f"snapshots copy a LoRA adapter and LLM {llm!r} has none (configure the lora initializer); "
                         "snapshots of fully trained weights are not supported yet")
    if served.llm.training.zero_stage == 3:
        raise ValueError(f"LLM {llm!r} uses ZeRO-3, which partitions every parameter when the engine is built: a "
                         "snapshot's parameters could not be added; use ZeRO 0-2 for snapshots")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a snapshot's name must be an identifier (letters, digits, _), got {name!r}")
    if name in served.adapters:
        raise ValueError(f"{name!r} is a trained adapter of LLM {llm!r}; give the snapshot another name")
    source = source or served.active_adapter()
    if source in served.snapshots:
        source = served.snapshots[source]  # a snapshot of a snapshot copies the same adapter's config
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


def adapter_params(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one LoRA adapter, keyed by their names with the adapter's name taken out."""
    marker = f".{adapter}."
    return {name.replace(marker, "."): p for name, p in model.named_parameters()
            if marker in name and "lora_" in name}


def take_snapshot(served: ServedModel, name: str, source: str | None, prefix_cache=None) -> dict:
    """Freeze a copy of adapter ``source`` (default: the active one) under ``name``."""
    source = check_can_snapshot(served, name, source)
    model = served.model
    if name in served.snapshots and served.snapshots[name] != source:
        drop_snapshot(served, name, prefix_cache)
    if name not in served.snapshots:
        with flags_kept(model):
            model.add_adapter(name, copy.deepcopy(model.peft_config[source]))
    copies, originals = adapter_params(model, name), adapter_params(model, source)
    if copies.keys() != originals.keys():
        raise RuntimeError(f"snapshot {name!r} does not mirror adapter {source!r}: parameters differ")
    with torch.no_grad():
        for key, p in copies.items():
            p.data = originals[key].detach().clone()
            p.requires_grad_(False)
    served.snapshots[name] = source
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"snapshot": name, "source": source, "bytes": snapshot_bytes(served, name)}


def drop_snapshot(served: ServedModel, name: str, prefix_cache=None) -> dict:
    if name not in served.snapshots:
        raise ValueError(f"LLM {served.llm.name!r} has no snapshot {name!r}; snapshots: "
                         f"{', '.join(sorted(served.snapshots)) or 'none'}")
    with flags_kept(served.model):
        served.model.delete_adapter(name)
    del served.snapshots[name]
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"dropped": name}


def snapshot_bytes(served: ServedModel, name: str) -> int:
    return sum(p.numel() * p.element_size() for p in adapter_params(served.model, name).values())


def snapshots_report(served: ServedModel) -> dict:
    """Every snapshot: the adapter it copies and its bytes (for ``server_memory``)."""
    return {name: {"source": source, "bytes": snapshot_bytes(served, name)}
            for name, source in sorted(served.snapshots.items())}
