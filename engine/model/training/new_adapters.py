"""LoRA adapters created and deleted while the servers run (``Caller.create_adapter`` / ``delete_adapter``).

A new adapter is a PEFT adapter added to the served model, its initial weights drawn from ``seed`` exactly as the
``lora`` initializer draws a config-declared adapter's (the same configuration and seed give the same weights),
and an optimizer parameter group of its own, tagged with its name (or an optimizer of its own, below): its moments and
steps are its own, and a step that trains another adapter leaves it bit-identical
(:mod:`llmrl.engine.model.training.optimizer`). ``targets`` names what it adapts: ``"attention"``, ``"mlp"``,
``"unembed"`` (the output layer), or module names as PEFT takes them; the default is PEFT's ``all-linear``
(attention and MLP).

Where the engine steps its torch optimizer itself (ZeRO 0 in float32) the adapter is a group of it. Where DeepSpeed owns
the step (ZeRO 1-3, bfloat16, float16) it keeps flat (and float32 master) copies of the parameters it was built with,
which a parameter added later cannot join: the adapter then stays outside them and steps with an optimizer of its own
(:mod:`llmrl.engine.model.training.own_optimizers`). Under ZeRO-3 such an adapter is whole on every rank, beside the
partitioned base (:mod:`llmrl.engine.model.zero3_state`). In float16 its gradients carry DeepSpeed's loss scale, which
its optimizer divides out (:mod:`llmrl.engine.model.training.loss_scale`). Under tensor parallelism a new adapter is
whole on every rank and applied in parts (:mod:`llmrl.engine.model.tp_lora`); it adapts layers the configured adapter
adapts, or layers left whole. With frozen-trunk reuse (``trunk_reuse_mb``) it adapts the layers above the trunk only
(:func:`above_trunk`), so the states kept across calls stay exact. Adapters created at run time are saved with a
checkpoint and created again, in order, on resume (:mod:`llmrl.engine.model.checkpoint`). Deleting one removes its
weights, its optimizer group and state, and its entries in the cache across calls; only adapters created at run time can
be deleted. Their count and bytes are capped (:mod:`llmrl.engine.model.adapter_caps`).

This module changes the model and optimizer of one rank; the request kind runs it on every rank of the LLM.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.adapter_caps import check_room
from llmrl.engine.model.reuse.trunk import layer_of
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.snapshots import adapter_params, check_adapter_name, flags_kept, parameters_changed
from llmrl.engine.model.tp_lora import check_split_targets, split_new_adapter
from llmrl.engine.model.training.lr_schedule import fit_new_groups
from llmrl.engine.model.training.optimizer import ADAPTER_KEY
from llmrl.engine.model.training.own_optimizers import OwnOptimizer
from llmrl.engine.model.version_counts import forget_version

TARGET_WORDS = ("attention", "mlp", "unembed")


def target_modules(model, targets, tensor_parallel: int = 1) -> str | list[str]:
    """PEFT's ``target_modules`` for ``targets`` (see the module doc). With ``tensor_parallel`` > 1, PEFT's
    ``all-linear`` would not find the split layers: it is the attention and MLP layers by name."""
    from peft.tuners.lora import Linear as LoraLinear

    if (targets is None or targets == "all-linear") and tensor_parallel <= 1:
        return "all-linear"
    targets = ["attention", "mlp"] if targets is None or targets == "all-linear" else targets
    targets = [targets] if isinstance(targets, str) else list(targets)
    names = []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for target in targets:
        if target not in TARGET_WORDS:
            names.append(target)
            continue
        for name, module in base.named_modules():
            # a layer an adapter already wraps (PEFT's lora.Linear holds the linear, maybe split, as base_layer) too,
            # and a layer split over tensor-parallel ranks that none wraps (check_split_targets refuses it by name)
            linear = isinstance(module, (torch.nn.Linear, LoraLinear)) or hasattr(module, "mp_group")
            if not linear or ".lora_" in f".{name}" or name.endswith("base_layer") or ".base_layer." in name:
                continue
            parts = name.split(".")
            if target == "unembed" and base.get_output_embeddings() in (module, getattr(module, "base_layer", None)):
                names.append(name)
            elif target == "attention" and any("attn" in p or "attention" in p for p in parts[:-1]):
                names.append(name)
            elif target == "mlp" and any(p in ("mlp", "feed_forward", "ffn") for p in parts[:-1]):
                names.append(name)
    if not names:
        raise ValueError(f"targets {targets} matched no linear module of this model")
    return sorted(set(names))


def above_trunk(model, targets, depth: int, who: str) -> list[str]:
    """The module names a new adapter adapts on a model whose layers below ``depth`` are a frozen trunk whose states
    are reused across calls (``trunk_reuse_mb``): of the words (``attention``, ``mlp``, ``unembed``, the default),
    the modules from layer ``depth`` up; a module name (PEFT's rule: the name, or the end of it) that reaches below
    is refused, naming the module."""
    words = ["attention", "mlp"] if targets is None or targets == "all-linear" else \
        [targets] if isinstance(targets, str) else list(targets)
    named = [t for t in words if t not in TARGET_WORDS]
    picked = target_modules(model, [t for t in words if t in TARGET_WORDS]) if len(named) < len(words) else []
    chosen = [name for name in picked if layer_of(name) is None or layer_of(name) >= depth]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for target in named:
        below = [name for name, _ in base.named_modules() if (name == target or name.endswith(f".{target}"))
                 and layer_of(name) is not None and layer_of(name) < depth]
        if below:
            raise ValueError(f"{who}: {below[0]} is in layer {layer_of(below[0])}, below layer {depth}, where the "
                             "frozen trunk whose states trunk_reuse_mb keeps across calls ends: adapt layers from "
                             f"{depth} up (the words attention and mlp pick them), or set trunk_reuse_mb to 0")
        chosen.append(target)
    return sorted(set(chosen))


def create_adapter(served: ServedModel, name: str, rank: int, alpha: float | None, seed: int, targets,
                   prefix_cache=None, dropout: float = 0.0) -> dict:
    from peft import LoraConfig, TaskType

    llm, model = served.llm.name, served.model
    if not hasattr(model, "peft_config"):
        raise ValueError(f"LLM {llm!r} holds no LoRA adapter to add to: configure the lora initializer (one adapter "
                         "declared in the config makes the model a PEFT model)")
    steps = served.adapter_steps
    if steps is None:
        raise ValueError(f"LLM {llm!r} holds no optimizer: set llms.{llm}.trainable: true to train new adapters")
    own = served.engine.optimizer is not steps.optimizer  # DeepSpeed's flat copies are built once: not joinable
    check_adapter_name(name, "an adapter")
    if name in served.adapters or name in served.run_time.snapshots:
        raise ValueError(f"LLM {llm!r} already has an adapter or snapshot named {name!r}")
    check_room(served, "adapter", name)
    task = TaskType.SEQ_2_SEQ_LM if served.llm.type == "seq2seq" else TaskType.CAUSAL_LM
    trunk = served.module.trunk  # (its states stay exact: the new adapter adapts no layer below its depth)
    modules = target_modules(model, targets, served.llm.tensor_parallel) if trunk is None else \
        above_trunk(model, targets, trunk.depth, f"LLM {llm!r}")
    config = LoraConfig(task_type=task, r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        lora_dropout=dropout, target_modules=modules)
    if served.llm.tensor_parallel > 1:
        check_split_targets(model, config.target_modules, f"LLM {llm!r}")
    devices = [served.device.index or 0] if served.device.type == "cuda" else []
    with flags_kept(model), torch.random.fork_rng(devices=devices):  # the run's own random streams go on unchanged
        torch.manual_seed(seed)
        model.add_adapter(name, config)
    params = list(adapter_params(model, name).values())
    try:
        split_new_adapter(model, name)
        check_room(served, "adapter", name, sum(p.numel() * p.element_size() for p in params))
        for p in params:
            p.requires_grad_(True)
        if own:
            served.run_time.optimizers[name] = OwnOptimizer(adapter_params(model, name),
                                                            served.llm.training.optimizer)
        else:
            steps.optimizer.add_param_group({"params": params, ADAPTER_KEY: name})
            fit_new_groups(getattr(served.engine, "lr_scheduler", None))  # its first step takes the schedule's rate
    except Exception:
        with flags_kept(model):
            model.delete_adapter(name)
        raise
    served.adapters.append(name)
    served.run_time.created[name] = {"rank": rank, "alpha": alpha, "seed": seed, "targets": targets}
    forget_version(served, name)  # a new adapter is at policy version 0
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"adapter": name, "parameters": sum(p.numel() for p in params)}


def delete_adapter(served: ServedModel, name: str, prefix_cache=None) -> dict:
    llm = served.llm.name
    if name not in served.run_time.created:
        declared = " (it was declared in the config)" if name in served.adapters else ""
        raise ValueError(f"{name!r} is not an adapter created at run time on LLM {llm!r}{declared}; created: "
                         f"{', '.join(served.run_time.created) or 'none'}")
    if name in served.pending.adapters:
        raise ValueError(f"adapter {name!r} has forward_backward gradients not yet applied: call optim_step first")
    if name in served.run_time.snapshots.values():
        users = sorted(k for k, v in served.run_time.snapshots.items() if v == name)
        raise ValueError(f"snapshot(s) {users} copy adapter {name!r}: drop them first")
    if served.run_time.optimizers.pop(name, None) is None:
        optimizer = served.adapter_steps.optimizer
        index = next(k for k, g in enumerate(optimizer.param_groups) if g.get(ADAPTER_KEY) == name)
        for p in optimizer.param_groups[index]["params"]:
            optimizer.state.pop(p, None)
        del optimizer.param_groups[index]
    with flags_kept(served.model):
        served.model.delete_adapter(name)
    served.adapters.remove(name)
    del served.run_time.created[name]
    served.pending.discarded.pop(name, None)  # a note of gradients lost on an adapter that is gone
    forget_version(served, name)
    parameters_changed(served)
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"deleted": name}
