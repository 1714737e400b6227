"""Checkpoints: atomic saves of every LLM of a run, exact resumes, and exports plain Hugging Face loads.

``Caller.save(path)`` writes into a staging folder next to ``path``; each LLM group writes
``<llm>/deepspeed`` (DeepSpeed's checkpoint: weights, heads, adapters, optimizer and engine state,
ZeRO partitions), ``<llm>/state`` (random generators and updater state of every rank, for an exact
resume) and ``<llm>/export`` (written by the group leader: the model as a Hugging Face folder, or each
LoRA adapter as a PEFT folder, the tokenizer, and the heads' weights). Only when every rank has
finished does the client write the manifest and swap the staging folder into place with renames, so
an interrupted save never leaves a half checkpoint where a good one was: until the new one is
complete, ``path`` (or, for the instant between two renames, its backup) holds the previous one.

A run resumes with ``llms.<name>.checkpoint: PATH`` in its config (same LLM layout: replicas,
tensor-parallel size, ZeRO stage, initializers, heads). On multi-node runs ``path`` must be on a
filesystem every node sees.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import torch

MANIFEST = "llmrl-checkpoint.json"
TAG = "llmrl"


# ----------------------------------------------------------------------------- client side


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint at ``path``, or its backup if a save was interrupted mid-swap."""
    path = Path(path).expanduser()
    if (path / MANIFEST).is_file():
        return path
    backups = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for backup in backups:
        if (backup / MANIFEST).is_file():
            return backup
    raise FileNotFoundError(f"no complete llmrl checkpoint at {path} (a folder written by Caller.save has {MANIFEST})")


def save_run(caller, path: str) -> str:
    """Write a checkpoint of every LLM to ``path`` atomically; returns the path."""
    from llmrl.engine import protocol
    from llmrl.engine.topology import replica_ranks

    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that was interrupted
    staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        every = [r for name in caller.llms for replica in replica_ranks(caller.config, name) for r in replica]
        future = caller._links.submit(protocol.SAVE, [(every, {"path": str(staging)})], lambda values: values)
        caller._wait(future)
        manifest = {"llms": caller.llms, "time": time.time(), "format": 1,
                    "layout": {name: {"replicas": llm.replicas, "tensor_parallel": llm.tensor_parallel,
                                      "zero_stage": llm.training.zero_stage}
                               for name, llm in caller.config.llms.items()}}
        _write_json(staging / MANIFEST, manifest)
        _fsync_dir(staging)
        backup = None
        if target.exists():
            backup = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, backup)
        os.rename(staging, target)
        _fsync_dir(target.parent)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(target)


def _write_json(path: Path, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- server side


def full_state_dict(runtime) -> dict[str, torch.Tensor] | None:
    """The whole module's state dict (heads and adapters included) on the group leader, None elsewhere.

    Collective: every rank of the LLM must call it (ZeRO-3 partitions and tensor-parallel shards are gathered).
    """
    engine = runtime.engine
    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state = engine._consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if runtime.role.group_rank == 0 else None
    if state is None:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def state_dict_request(runtime, payload: dict):
    prefix = payload.get("prefix") or ""
    if payload.get("replica") is not None:  # this replica's own copy (replicated layouts only)
        if runtime.engine.zero_optimization_partition_weights() or runtime.llm.tensor_parallel > 1:
            raise ValueError("replica= reads one replica's own weights; with ZeRO-3 or tensor parallelism no replica "
                             "holds whole weights: call state_dict without replica=")
        state = runtime.engine.module.state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if k.startswith(prefix)}
    state = full_state_dict(runtime)
    if state is None:
        return None
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def save_shard(runtime, staging: str):
    """This rank's part of a save (collective over the LLM's ranks)."""
    llm_dir = Path(staging) / runtime.llm.name
    runtime.engine.save_checkpoint(str(llm_dir / "deepspeed"), tag=TAG)
    delay = float(os.environ.get("LLMRL_TEST_SAVE_DELAY", "0"))  # fault injection: tests crash a run mid-save
    if delay:
        time.sleep(delay)
    state_dir = llm_dir / "state"
    state_dir.mkdir(parents=True, exist_ok=True)
    updater_state = runtime.updater.state_dict() if hasattr(runtime.updater, "state_dict") else None
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "updater": updater_state,
                "cuda": torch.cuda.get_rng_state(runtime.device) if runtime.device.type == "cuda" else None},
               state_dir / f"rank-{runtime.role.group_rank}.pt")
    state = full_state_dict(runtime)
    if state is not None:
        _export(runtime, state, llm_dir / "export")
    return True


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _export(runtime, state: dict, folder: Path) -> None:
    """A folder plain transformers / peft can load: the model (or adapters), tokenizer and heads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model_state = _strip(state, "model.")
    model = runtime.model
    runtime.tokenizer.save_pretrained(folder / "tokenizer")
    if hasattr(model, "peft_config"):
        for adapter in runtime.adapters:
            # PEFT names adapter weights with the adapter's name; a saved adapter drops it.
            marker = f".{adapter}."
            weights = {k.replace(marker, "."): v.clone().contiguous() for k, v in model_state.items()
                       if "lora_" in k and marker in k}
            out = folder / "adapters" / adapter
            out.mkdir(parents=True, exist_ok=True)
            model.peft_config[adapter].save_pretrained(out)
            save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
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
        _write_json(folder / "heads.json", {k: {"plugin": s.plugin, "args": s.args}
                                            for k, s in runtime.head_specs.items()})


def load_checkpoint(runtime, path: str) -> None:
    """Restore this rank's engine, optimizer, generators and updater from a checkpoint (collective)."""
    root = resolve_checkpoint(path)
    llm_dir = root / runtime.llm.name
    if not llm_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {root} has no LLM named {runtime.llm.name!r}; it holds "
                                f"{sorted(p.name for p in root.iterdir() if p.is_dir())}")
    load_optimizer = runtime.engine.optimizer is not None
    loaded, _ = runtime.engine.load_checkpoint(str(llm_dir / "deepspeed"), tag=TAG,
                                               load_optimizer_states=load_optimizer,
                                               load_lr_scheduler_states=load_optimizer,
                                               load_module_only=not load_optimizer)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {llm_dir / 'deepspeed'}")
    state_file = llm_dir / "state" / f"rank-{runtime.role.group_rank}.pt"
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if state.get("cuda") is not None and runtime.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], runtime.device)
        if state.get("updater") is not None and hasattr(runtime.updater, "load_state_dict"):
            runtime.updater.load_state_dict(state["updater"])
