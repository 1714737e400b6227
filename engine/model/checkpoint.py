"""Checkpoints on a server rank: this rank's part of a save, a resume, full state dicts, plain-HF exports.

``save_shard`` writes, into the staging folder the client chose, ``<llm>/deepspeed`` (DeepSpeed's
checkpoint: weights, heads, adapters, optimizer and engine state, ZeRO partitions), ``<llm>/state`` (random
generators and updater state of every rank, for an exact resume) and ``<llm>/export`` (written by the group
leader: the model as a Hugging Face folder, or each LoRA adapter as a PEFT folder, the tokenizer, and the
heads' weights). The client swaps the staging folder into place (:mod:`llmrl.engine.client.saving`).
``load_checkpoint`` restores all of it when ``llms.<name>.checkpoint`` names a checkpoint (same LLM layout). The
rank state also lists the policy versions (:mod:`llmrl.engine.model.version_counts`: they go on counting after a
resume), the LoRA adapters created at run time and the snapshots (made again, in order, before
DeepSpeed loads their weights and optimizer state; with the float32 masters and moments of those that step with an
optimizer of their own, :mod:`llmrl.engine.model.training.own_optimizers`), and
``state/weight-snapshots-rank-<r>.pt`` holds the frozen weights of a model trained without LoRA. A save is refused
while ``forward_backward`` gradients are pending.

This module works on a :class:`~llmrl.engine.model.served.ServedModel`; it does not choose paths.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from llmrl.engine.checkpoint_layout import TAG, read_manifest, resolve_checkpoint
from llmrl.engine.files import fsync_tree, write_json
from llmrl.engine.log import logger
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.zero3_state import zero3_state_dict


def full_state_dict(served: ServedModel) -> dict[str, torch.Tensor] | None:
    """The whole module's state dict (heads and adapters included) on the group leader, None elsewhere.

    Collective: every rank of the LLM must call it (ZeRO-3 partitions and tensor-parallel shards are gathered).
    """
    engine = served.engine
    if engine.zero_optimization_partition_weights():  # (run-time adapters are whole: not DeepSpeed's to gather)
        state = zero3_state_dict(engine.module, served.role.group_rank == 0, engine.autotp_size() > 1)
    elif engine.autotp_size() > 1:
        state = engine._consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if served.role.group_rank == 0 else None
    if state is None:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def own_state_dict(served: ServedModel) -> dict[str, torch.Tensor]:
    """This replica's own copy of the weights (replicated layouts only: ZeRO 0-2 without tensor parallelism)."""
    if served.engine.zero_optimization_partition_weights() or served.llm.tensor_parallel > 1:
        raise ValueError("replica= reads one replica's own weights; with ZeRO-3 or tensor parallelism no replica "
                         "holds whole weights: call state_dict without replica=")
    state = served.engine.module.state_dict()
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def save_shard(served: ServedModel, staging: str) -> None:
    """This rank's part of a save (collective over the LLM's ranks)."""
    if served.pending.backwards:
        raise ValueError(f"LLM {served.llm.name!r} holds the gradients of {served.pending.backwards} forward_backward "
                         "call(s) not yet applied, which a checkpoint does not keep: call optim_step() before save()")
    llm_dir = Path(staging) / served.llm.name
    served.engine.save_checkpoint(str(llm_dir / "deepspeed"), tag=TAG)
    save_rank_state(served, llm_dir / "state")
    state = full_state_dict(served)
    if state is not None:
        _export(served, state, llm_dir / "export")
    fsync_tree(llm_dir)  # on disk before the client's manifest vouches for it


def save_rank_state(served: ServedModel, state_dir: Path) -> None:
    """The random generators and the updater's state of this rank (what an exact resume needs beyond DeepSpeed's)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    updater_state = served.updater.state_dict() if hasattr(served.updater, "state_dict") else None
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "updater": updater_state,
                "created_adapters": [[name, how] for name, how in served.run_time.created.items()],
                "snapshots": dict(served.run_time.snapshots), "scalings": _adapter_scalings(served),
                "own_optimizers": {name: own.state_dict() for name, own in served.run_time.optimizers.items()},
                "policy_versions": [[name, count] for name, count in served.run_time.versions.items()],
                "cuda": torch.cuda.get_rng_state(served.device) if served.device.type == "cuda" else None},
               state_dir / f"rank-{served.role.group_rank}.pt")
    weight_snapshots = served.run_time.weight_snapshots
    if weight_snapshots:  # a model trained without LoRA: its snapshots are copies of its trained weights
        copies = {name: {k: v.cpu() for k, v in weights.items()} for name, weights in weight_snapshots.items()}
        torch.save(copies, state_dir / f"weight-snapshots-rank-{served.role.group_rank}.pt")


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _export(served: ServedModel, state: dict, folder: Path) -> None:
    """A folder plain transformers / peft can load: the model (or adapters), tokenizer and heads. With adapters,
    base weights trained beside them go to ``trained_base_weights.safetensors`` (the base model's names: load them
    into the base model before the adapters; a PEFT adapter alone would leave them untrained)."""
    from safetensors.torch import save_file

    from llmrl.engine.model.snapshots import without_adapter

    folder.mkdir(parents=True, exist_ok=True)
    model_state = _strip(state, "model.")
    model = served.model
    served.tokenizer.save_pretrained(folder / "tokenizer")
    if hasattr(model, "peft_config"):
        for adapter in served.adapters:
            # PEFT names adapter weights with the adapter's name; a saved adapter drops it.
            weights = {key: v.clone().contiguous() for k, v in model_state.items()
                       if (key := without_adapter(k, adapter)) is not None}
            out = folder / "adapters" / adapter
            out.mkdir(parents=True, exist_ok=True)
            model.peft_config[adapter].save_pretrained(out)
            save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
        # base weights trained beside the adapters (the freeze initializer's unfreeze): a PEFT adapter holds none
        trained = {name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name}
        if trained:  # named as in the base model: a layer LoRA wraps holds its own weight under ``.base_layer``
            save_file({k.removeprefix("base_model.model.").replace(".base_layer.", "."): v.clone().contiguous()
                       for k, v in model_state.items() if k in trained},
                      folder / "trained_base_weights.safetensors", metadata={"format": "pt"})
    else:
        out = folder / "model"
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
        save_file({k: v.clone().contiguous() for k, v in model_state.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})
    heads = _strip(state, "heads.")
    if heads:
        save_file({k: v.clone().contiguous() for k, v in heads.items()}, folder / "heads.safetensors",
                  metadata={"format": "pt"})
        write_json(folder / "heads.json", {k: {"plugin": s.plugin, "args": s.args}
                                           for k, s in served.head_specs.items()})


def load_checkpoint(served: ServedModel, path: str) -> None:
    """Restore this rank's engine, optimizer, generators and updater from a checkpoint (collective)."""
    root = resolve_checkpoint(path)
    llm_dir = root / served.llm.name
    if not llm_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {root} has no LLM named {served.llm.name!r}; it holds "
                                f"{sorted(p.name for p in root.iterdir() if p.is_dir())}")
    state_file = llm_dir / "state" / f"rank-{served.role.group_rank}.pt"
    manifest = read_manifest(root) or {}
    layout = (manifest.get("layout") or {}).get(served.llm.name)
    written = state_file.parent.is_dir() or manifest.get("format", 1) >= 2  # format 2: every saving rank wrote one
    if written and not state_file.is_file():  # not this layout, or a partial copy of the checkpoint
        held = sorted(p.name for p in state_file.parent.glob("rank-*.pt"))
        raise FileNotFoundError(f"checkpoint {root} holds no state for rank {served.role.group_rank} of LLM "
                                f"{served.llm.name!r} ({state_file.name}; it holds {held}): its generators and "
                                f"updater state would start afresh; resume with the layout it was saved with "
                                f"({layout}), from a whole copy of the checkpoint")
    if layout and (layout.get("replicas"), layout.get("tensor_parallel")) != (served.llm.replicas,
                                                                                served.llm.tensor_parallel):
        logger.warning(f"LLM {served.llm.name!r} resumes from {root}, saved with {layout['replicas']} replica(s) and "
                       f"tensor_parallel {layout['tensor_parallel']}, with {served.llm.replicas} and "
                       f"{served.llm.tensor_parallel} now: the replicas' generators and updater states are not those "
                       "the saved run would have had")
    _refuse_other_optimizer(served, root, layout or {})
    state = torch.load(state_file, weights_only=True) if state_file.is_file() else {}  # plain data: nothing runs
    _recreate_adapters(served, state)
    _check_scalings(served, root, state.get("scalings"))
    load_optimizer = served.engine.optimizer is not None
    loaded, _ = served.engine.load_checkpoint(str(llm_dir / "deepspeed"), tag=TAG,
                                               load_optimizer_states=load_optimizer,
                                               load_lr_scheduler_states=load_optimizer,
                                               load_module_only=not load_optimizer)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {llm_dir / 'deepspeed'}")
    if hasattr(served.engine.optimizer, "clip_grad"):  # DeepSpeed's ZeRO-1/2 and bf16 optimizers load the saved one
        served.engine.optimizer.clip_grad = float(served.llm.training.gradient_clipping)  # the config's, as ZeRO-0
    if load_optimizer and served.adapter_steps is not None:
        apply_config_settings(served, root)
    for name, own in served.run_time.optimizers.items():  # masters and moments of run-time adapters stepped apart
        saved = (state.get("own_optimizers") or {}).get(name)
        if saved is None:
            raise ValueError(f"checkpoint {root} holds no optimizer state of adapter {name!r}, created at run time on "
                             f"LLM {served.llm.name!r} (saved by another layout, ZeRO 0 in float32?): resume with the "
                             "ZeRO stage and dtype it was saved with")
        own.load_state_dict(saved)
    snapshots_file = llm_dir / "state" / f"weight-snapshots-rank-{served.role.group_rank}.pt"
    if snapshots_file.is_file():
        served.run_time.weight_snapshots = torch.load(snapshots_file, weights_only=True, map_location=served.device)
        from llmrl.engine.model.partitioned_snapshots import check_held

        params = dict(served.module.named_parameters())
        for name, frozen in served.run_time.weight_snapshots.items():
            check_held(params, name, frozen)
    if state:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if state.get("cuda") is not None and served.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], served.device)
        if state.get("updater") is not None and hasattr(served.updater, "load_state_dict"):
            served.updater.load_state_dict(state["updater"])
        if "policy_versions" in state:  # the steps each policy had taken go on from there (a checkpoint written
            served.run_time.versions = {name: count for name, count in state["policy_versions"]}  # before: from 0


def _refuse_other_optimizer(served: ServedModel, root, layout: dict) -> None:
    """The optimizer's state is laid out by its kind and ZeRO stage: resuming under others fails deep inside
    DeepSpeed (a KeyError, a missing file), or worse. Refused naming both."""
    training = served.llm.training
    family = {1: 2}  # ZeRO 1 and 2 write the same optimizer state files
    stage, optimizer = layout.get("zero_stage"), layout.get("optimizer")
    now_stage = training.zero_stage
    changed = [f"{what} {saved!r} (the config gives {now!r})" for what, saved, now, same in (
        ("ZeRO stage", stage, now_stage, family.get(stage, stage) == family.get(now_stage, now_stage)),
        ("optimizer", optimizer, training.optimizer.type, optimizer == training.optimizer.type))
        if saved is not None and not same]
    if changed and served.adapter_steps is not None:
        raise ValueError(f"LLM {served.llm.name!r} cannot resume from {root}: it was saved with "
                         f"{' and '.join(changed)}; its optimizer state holds that layout: resume with the saved "
                         "settings")


def apply_config_settings(served: ServedModel, root) -> None:
    """DeepSpeed loads the saved optimizer's hyperparameters with its state; the config's (``training.optimizer``:
    lr, betas, eps, weight decay, momentum) apply instead, the schedule's rate recomputed from the config's lr at the
    saved step. A change is logged. Under a scheduler of DeepSpeed's own (``training.deepspeed``), which sets the
    rate and may cycle the betas, the checkpoint's stand."""
    spec = served.llm.training.optimizer
    scheduler = getattr(served.engine, "lr_scheduler", None)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is not None and not lambdas:  # DeepSpeed's own (training.deepspeed): it sets lr, even betas
        return
    wanted = {"betas": tuple(spec.betas), "eps": spec.eps, "weight_decay": spec.weight_decay, "momentum": spec.momentum}
    changes = set()
    for group in served.adapter_steps.optimizer.param_groups:
        if lambdas:
            if group.get("initial_lr", spec.lr) != spec.lr:
                changes.add(f"lr {group['initial_lr']} -> {spec.lr}")
            group["initial_lr"], group["lr"] = spec.lr, spec.lr * lambdas[0](max(scheduler.last_epoch, 0))
        elif scheduler is None:
            if group["lr"] != spec.lr:
                changes.add(f"lr {group['lr']} -> {spec.lr}")
            group["lr"] = spec.lr
        for key, value in wanted.items():
            if key in group and (tuple(group[key]) if key == "betas" else group[key]) != value:
                changes.add(f"{key} {group[key]} -> {value}")
                group[key] = value
    if lambdas:
        scheduler.base_lrs = [spec.lr] * len(scheduler.base_lrs)
    if changes:
        logger.warning(f"LLM {served.llm.name!r} resumes from {root} with the config's {', '.join(sorted(changes))} "
                       "(the checkpoint's values are replaced)")


def _recreate_adapters(served: ServedModel, state: dict) -> None:
    """The adapters created at run time (in their order: the optimizer's groups follow it) and the snapshots the
    checkpoint holds, made again so that its weights and optimizer state have somewhere to go."""
    from llmrl.engine.model.snapshots import take_snapshot
    from llmrl.engine.model.training.new_adapters import create_adapter

    for name, how in state.get("created_adapters") or []:
        if name not in served.run_time.created:
            create_adapter(served, name, **how)
    for name, source in (state.get("snapshots") or {}).items():
        take_snapshot(served, name, source)  # its weights come with the checkpoint's


def _adapter_scalings(served: ServedModel) -> dict:
    """Each LoRA adapter's scalings (alpha / r per layer): what its saved weights were trained under."""
    from llmrl.engine.model.training.adapter_state import scalings

    return {name: scalings(served.model, name) for name in served.adapters} if hasattr(served.model, "peft_config") \
        else {}


def _check_scalings(served: ServedModel, root: Path, saved: dict | None) -> None:
    """Refuse to resume adapters whose LoRA alpha or rank changed since the save: DeepSpeed would load their weights
    under the new config's scaling, and they would act scaled differently (checkpoints saved without: not checked)."""
    here = _adapter_scalings(served)
    for name, layers in (saved or {}).items():
        now = here.get(name, {})
        differ = next((k for k, v in layers.items() if k in now and not abs(now[k] - v) <= 1e-6 * abs(v)), None)
        if differ is not None:
            raise ValueError(f"LLM {served.llm.name!r} resumes from {root}, whose adapter {name!r} was trained with "
                             f"LoRA scaling (alpha / r) {layers[differ]} at {differ}; the config gives {now[differ]}: "
                             f"its weights would act scaled differently. Resume with the saved lora alpha and rank")
