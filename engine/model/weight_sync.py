"""Weight sync between two LLMs of a run, server side (``Caller.sync_weights``): the learner's weights read whole on
its ranks (:func:`read_weights`), then written into the sampler's copy on every rank of the sampler
(:func:`write_weights`), with the learner's policy version, so that the sampler's samples say which weights they
were drawn from.

What is synced: one LoRA adapter's weights (megabytes; the adapter of the same name on both sides, of the same
shapes; by default the learner's active adapter), or, for a learner without LoRA, every tensor of its module that
the sampler holds too (its base model and heads: the whole model). The learner may be laid out in any way
(replicas, ZeRO 0-3, tensor parallelism: its weights are gathered as ``Caller.state_dict`` gathers them). The
sampler holds whole weights on each rank and does not train (``trainable: false``): its weights are written in
place, between two of its requests (a ``generate`` in progress finishes on the weights it started with), and its
cache of keys and values is dropped. Every name, shape and value is checked before anything is written: a mismatch
is refused naming the tensor, and the sampler keeps its weights.

This module reads and writes weights; the client relays them (:mod:`llmrl.engine.requests.read_weights`,
:mod:`llmrl.engine.requests.write_weights`) and nothing here chooses when to sync.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.checkpoint import full_state_dict
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.snapshots import without_adapter
from llmrl.engine.model.version_counts import version_of


def read_weights(served: ServedModel, adapter: str | None) -> dict | None:
    """The weights to sync, as CPU tensors named as in the module's state dict, and their policy version; on the
    group leader (None on the other ranks). Collective over the LLM's ranks. ``adapter`` None: the active adapter
    of a model with LoRA, the whole model without."""
    adapter = adapter if adapter is not None else served.active_adapter()
    if adapter is not None:
        served.check_adapter(adapter)
        if adapter not in served.adapters:
            raise ValueError(f"{adapter!r} is a snapshot of LLM {served.llm.name!r}; sync an adapter")
    version = version_of(served, adapter)
    state = full_state_dict(served)
    if state is None:
        return None
    if adapter is not None:
        state = {k: v for k, v in state.items() if without_adapter(k, adapter) is not None}
    else:  # the trained weights: no adapter's, no snapshot's
        state = {k: v for k, v in state.items() if not _adapter_key(k, served)}
    return {"weights": state, "version": version, "adapter": adapter, "llm": served.llm.name}


def _adapter_key(key: str, served: ServedModel) -> bool:
    names = [*served.adapters, *served.run_time.snapshots]
    return any(without_adapter(key, name) is not None for name in names)


def write_weights(served: ServedModel, weights: dict, adapter: str | None, version: int, source: str,
                  prefix_cache=None) -> dict:
    """Copy ``weights`` (from :func:`read_weights` on LLM ``source``) into this rank's model, in place, and give
    the synced policy the source's ``version``."""
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
    here = served.module.state_dict(keep_vars=True)
    missing = sorted(set(weights) - set(here))
    if missing:
        raise ValueError(f"LLM {source!r}'s {_what(adapter)} has tensors LLM {llm!r} does not hold (e.g. "
                         f"{missing[:3]}): sync between LLMs of the same model, with the same LoRA targets and heads")
    if adapter is not None:
        ours = sorted(k for k in here if without_adapter(k, adapter) is not None)
        if ours != sorted(weights):
            raise ValueError(f"adapter {adapter!r} of LLM {llm!r} has tensors that LLM {source!r}'s lacks (e.g. "
                             f"{sorted(set(ours) - set(weights))[:3]}): give both the same LoRA rank and targets")
    for key, value in weights.items():
        target = here[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{key}: LLM {source!r} holds shape {tuple(value.shape)}, LLM {llm!r} "
                             f"{tuple(target.shape)}; sync between LLMs of the same model and LoRA rank")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{key}: LLM {source!r}'s weights hold non-finite values; nothing was synced")
    with torch.no_grad():
        for key, value in weights.items():
            here[key].copy_(value.to(device=here[key].device, dtype=here[key].dtype))
    served.run_time.versions[adapter if adapter is not None else None] = int(version)
    if prefix_cache is not None:
        if adapter is not None:
            prefix_cache.forget(adapter)
        else:
            prefix_cache.clear()
    return {"tensors": len(weights), "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
            "policy_version": int(version)}


def _what(adapter: str | None) -> str:
    return f"adapter {adapter!r}" if adapter is not None else "weights"
