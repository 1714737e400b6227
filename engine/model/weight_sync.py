"""Weight sync between two LLMs of a run, server side (``Caller.sync_weights``): the learner's weights read whole on
its ranks (:func:`read_weights`), then written into the sampler's copy on every rank of the sampler
(:func:`write_weights`), with the learner's policy version, so that the sampler's samples say which weights they
were drawn from.

What is synced: one LoRA adapter's weights (megabytes; the adapter of the same name on both sides, of the same
shapes and scaling, on the same base weights; by default the learner's active adapter), or, for a learner without
LoRA, its whole module (the sampler must hold exactly the same tensors). A learner that trains other tensors beside
its adapter (``freeze``'s ``unfreeze``, PEFT's ``modules_to_save``) is refused: the sampler would miss them. The
learner may be laid out in any way (replicas, ZeRO 0-3, tensor parallelism: partitioned weights are gathered as
``Caller.state_dict`` gathers them; whole ones are read on the group leader, the adapter's alone). The sampler
holds whole weights on each rank and does not train (``trainable: false``): its weights are written in place,
between two of its requests, or, for a write sent in flight, between two decode batches of the ``generate`` in
progress (:func:`writes_between_batches`: the samples drawn before keep the old version), and its cache of keys and
values is dropped. Every tensor is checked (name, shape, and its values finite once cast to the
sampler's type) before any is written: a mismatch is refused naming the tensor, and the sampler keeps its weights.

This module reads and writes weights; they travel over a group of the two LLMs' ranks
(:mod:`llmrl.engine.model.weight_channel`) or through the client (:mod:`llmrl.engine.requests.read_weights`,
:mod:`llmrl.engine.requests.write_weights`), and nothing here chooses when to sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmrl.engine.model.checkpoint import full_state_dict
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.snapshots import without_adapter
from llmrl.engine.model.training.adapter_state import base_sample, scalings
from llmrl.engine.model.version_counts import stamped, version_of


def read_weights(served: ServedModel, adapter: str | None, copy: bool = True) -> dict | None:
    """The weights to sync, as CPU tensors named as in the module's state dict, and their policy version; on the
    group leader (None on the other ranks). Collective over the LLM's ranks. ``adapter`` None: the active adapter
    of a model with LoRA, the whole model without. ``copy=False``: whole weights on the CPU are the module's own
    tensors (for a caller that copies them before the module changes)."""
    adapter = adapter if adapter is not None else served.active_adapter()
    if adapter is not None:
        served.check_adapter(adapter)
        if adapter not in served.adapters:
            raise ValueError(f"{adapter!r} is a snapshot of LLM {served.llm.name!r}; sync an adapter")
        others = [name for name, p in served.model.named_parameters()
                  if p.requires_grad and not _adapter_key(name, served)]
        if others:
            raise ValueError(f"LLM {served.llm.name!r} trains {len(others)} tensor(s) beside its adapters (e.g. "
                             f"{others[:2]}: unfreeze or modules_to_save), which sync_weights would not copy: sync "
                             "a learner that trains its LoRA adapter only")
    version = version_of(served, adapter)

    def wanted(key: str) -> bool:
        return without_adapter(key, adapter) is not None if adapter is not None else not _adapter_key(key, served)

    engine = served.engine
    split = engine.autotp_size() > 1 and adapter is None  # (adapters are whole on every tensor-parallel rank)
    if engine.zero_optimization_partition_weights() or split:
        state = full_state_dict(served)  # gathered collectively; the leader keeps what is synced
        if state is None:
            return None
        state = {k: v for k, v in state.items() if wanted(k)}
    elif served.role.group_rank != 0:
        return None
    else:  # whole weights here: copy only what is synced
        state = {k: v.detach().to("cpu", copy=copy) for k, v in engine.module.state_dict().items() if wanted(k)}
    checks = {"scalings": scalings(served.model, adapter), "base": base_sample(served.model, adapter)} \
        if adapter is not None else {}
    return {"weights": state, "version": version, "adapter": adapter, "llm": served.llm.name, **checks}


def read_to_send(served: ServedModel, request, channels) -> dict | None:
    """A ``read_weights`` request: :func:`read_weights`, whose tensors, when the request names a target LLM
    (``via="group"``), are staged on this group leader's channel to it instead of returned
    (:meth:`llmrl.engine.model.weight_channel.WeightChannels.stage`: the answer's ``staged``)."""
    read = read_weights(served, request.adapter, copy=request.to is None)  # staging copies them into its buffer
    if read is not None and request.to is not None:
        read["staged"] = channels.stage(request.to, request.to_rank_count, read.pop("weights"))
    return read


def write_sent(served: ServedModel, request, channels, prefix_cache) -> dict:
    """A ``write_weights`` request: the weights it carries, or, when they were staged on the source
    (``request.staged``), those received over the pair's group (received before anything else is checked, so the
    group's sends and receives stay paired), written by :func:`write_weights`."""
    weights = request.weights if request.staged is None else channels.receive(request.staged)
    return write_weights(served, weights, request.adapter, request.version, request.source, prefix_cache,
                         request.checks)


def writes_between_batches(served: ServedModel, adapter: str | None, take) -> Callable | None:
    """For a ``generate`` reading ``adapter``: the ``between_batches`` hook of
    :func:`llmrl.engine.model.generation.generate` that takes a weight write sent in flight when it is the next
    request queued (``take``: the backend's ``queued_write_taker``; None: no hook), stamping the samples drawn so
    far with the weights they came from first. Never while a weight snapshot's tensors are swapped in for the read:
    a whole-model write would land in the snapshot's copies."""
    if take is None:
        return None

    def between(results: list[list[dict]]) -> None:
        if served.run_time.swapped_in is None:
            take(lambda: stamped(results, served, adapter))

    return between


def _adapter_key(key: str, served: ServedModel) -> bool:
    names = [*served.adapters, *served.run_time.snapshots]
    return any(without_adapter(key, name) is not None for name in names)


def write_weights(served: ServedModel, weights: dict, adapter: str | None, version: int, source: str,
                  prefix_cache=None, checks: dict | None = None) -> dict:
    """Copy ``weights`` (from :func:`read_weights` on LLM ``source``) into this rank's model, in place, and give
    the synced policy the source's ``version``. ``checks``: the source adapter's ``scalings`` and ``base`` sample,
    compared with this model's before anything is written."""
    llm = served.llm.name
    if served.adapter_steps is not None:
        raise ValueError(f"sync_weights writes into LLM {llm!r}, which trains (it holds an optimizer, whose own copy "
                         f"of the weights the sync would not reach): sync into an LLM with trainable: false")
    if served.llm.training.zero_stage == 3 or served.llm.tensor_parallel > 1:
        raise ValueError(f"sync_weights writes whole weights on each rank; LLM {llm!r} partitions them (ZeRO-3 or "
                         "tensor parallelism): serve the sampler with replicas instead")
    if adapter is not None:
        served.check_adapter(adapter)
        if adapter not in served.adapters:
            raise ValueError(f"{adapter!r} is a snapshot of LLM {llm!r}; sync into an adapter of that name")
        _check_same_adapter(served, adapter, source, checks or {})
    here = served.module.state_dict(keep_vars=True)
    missing = sorted(set(weights) - set(here))
    if missing:
        raise ValueError(f"LLM {source!r}'s {_what(adapter)} has tensors LLM {llm!r} does not hold (e.g. "
                         f"{missing[:3]}): sync between LLMs of the same model, with the same LoRA targets and heads")
    ours = sorted(k for k in here if without_adapter(k, adapter) is not None) if adapter is not None else \
        sorted(k for k in here if not _adapter_key(k, served))
    if ours != sorted(weights):
        raise ValueError(f"LLM {llm!r} holds tensors that LLM {source!r}'s {_what(adapter)} lacks (e.g. "
                         f"{sorted(set(ours) - set(weights))[:3]}): sync between LLMs of the same model, LoRA rank "
                         "and targets")
    cast = {}
    for key, value in weights.items():
        target = here[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{key}: LLM {source!r} holds shape {tuple(value.shape)}, LLM {llm!r} "
                             f"{tuple(target.shape)}; sync between LLMs of the same model and LoRA rank")
        cast[key] = value.to(device=target.device, dtype=target.dtype)
        if cast[key].is_floating_point() and not bool(torch.isfinite(cast[key]).all()):
            raise ValueError(f"{key}: LLM {source!r}'s weights hold values that are not finite in LLM {llm!r}'s "
                             f"{target.dtype}; nothing was synced")
    with torch.no_grad():
        for key, value in cast.items():
            here[key].copy_(value)
    served.run_time.versions[adapter] = int(version)
    if prefix_cache is not None:
        if adapter is not None:
            prefix_cache.forget(adapter)
        else:
            prefix_cache.clear()
    return {"tensors": len(weights), "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
            "policy_version": int(version), "adapter": adapter}


def _check_same_adapter(served: ServedModel, adapter: str, source: str, checks: dict) -> None:
    """Refuse an adapter whose LoRA scaling (alpha / r) differs, or that was trained on other base weights: its
    weights would compute another function here (values compared to 1%, as a bfloat16 base rounds them)."""
    llm = served.llm.name
    theirs, ours = checks.get("scalings") or {}, scalings(served.model, adapter)
    differ = next((k for k, v in ours.items() if not abs(theirs.get(k, float("nan")) - v) <= 1e-6 * abs(v)), None)
    if differ is not None:
        raise ValueError(f"adapter {adapter!r}: its LoRA scaling (alpha / r) at {differ} is {theirs.get(differ)} in "
                         f"LLM {source!r} and {ours[differ]} in LLM {llm!r}; give both the same rank and alpha")
    here = base_sample(served.model, adapter)
    for key, sample in (checks.get("base") or {}).items():
        if key in here and (here[key].shape != sample.shape
                            or not torch.allclose(here[key], sample, rtol=1e-2, atol=1e-6)):
            raise ValueError(f"adapter {adapter!r}: LLM {source!r} trains it on other base weights than LLM {llm!r} "
                             f"serves (they differ at {key}); sync between LLMs of the same model")


def _what(adapter: str | None) -> str:
    return f"adapter {adapter!r}" if adapter is not None else "weights"
