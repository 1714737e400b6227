"""One LoRA adapter's state in a folder of its own, saved and loaded while the servers run
(``Caller.save_adapter`` / ``load_adapter``; Tinker's ``save_state`` and training clients created from a state).

``save_adapter`` writes ``<path>/adapter_state.pt``: the adapter's weights, how to make it again (rank, alpha, targets)
and, on a trainable LLM, its optimizer state (each parameter's Adam moments and step count), plus ``<path>/peft``
(``adapter_config.json`` and ``adapter_model.safetensors``, which plain ``peft`` loads). The LLM's group leader writes
(the replicas hold the same weights); the folder must not exist yet, so nothing is overwritten. It is written as
``.<name>.partial-<pid>`` beside it and renamed when whole; such a folder that a save killed half-way left behind is
removed, with a log line, by the next save into the same parent folder. ``load_adapter`` reads it on every rank: into an
adapter created at run time under the given name (or into an existing adapter of the same shapes, in place), with the
saved optimizer state or, without it, fresh moments. Both refuse while the adapter has ``forward_backward`` gradients
pending (they are not saved). The state is kept per parameter: in the engine's torch optimizer at ZeRO 0 in float32, in
the adapter's own optimizer (moments of its float32 masters) for an adapter created at run time under ZeRO 1-3 or
bfloat16; a configured adapter there is in DeepSpeed's flat buffers and refused. Under ZeRO-3 an adapter created at run
time is whole on every rank and saved as it is; weights that ZeRO-3 partitions are refused. Under tensor parallelism
adapters are whole on every rank (:mod:`llmrl.engine.model.tp_lora`), and the sample of the base weights leaves the
split layers out. A bfloat16 adapter is saved and loaded as its bfloat16 weights: loading one makes its masters from
those. Every field of a state is checked before anything changes
(:mod:`llmrl.engine.model.training.adapter_state_checks`): a damaged or crafted file is refused naming the field, and
the adapter keeps its weights and moments.

This module does not save the run (:mod:`llmrl.engine.model.checkpoint` does) nor choose paths.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from llmrl.engine.log import logger
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.snapshots import adapter_params
from llmrl.engine.model.training.adapter_state_checks import check_against, check_values, loaded

STATE_FILE = "adapter_state.pt"
FORMAT = 1


def _check(served: ServedModel, name: str, what: str) -> None:
    llm = served.llm.name
    if any(hasattr(p, "ds_id") for p in adapter_params(served.model, name).values()):
        # an adapter created at run time is whole on every rank under ZeRO-3; a configured one is partitioned
        raise ValueError(f"{what} reads whole adapter weights on one rank; LLM {llm!r} partitions adapter {name!r} "
                         "(ZeRO-3 partitions the adapters declared in the config): use Caller.save for the whole "
                         "run, or an adapter created at run time")
    steps = served.adapter_steps
    declared = name in served.adapters and name not in served.run_time.created
    if steps is not None and served.engine.optimizer is not steps.optimizer and declared:
        raise ValueError(f"{what} keeps an adapter's optimizer state per parameter; LLM {llm!r} runs ZeRO "
                         f"{served.llm.training.zero_stage} in {served.llm.dtype}, where DeepSpeed holds adapter "
                         f"{name!r} (declared in the config) in its flat buffers: use Caller.save for the whole run, "
                         "or an adapter created at run time (which steps with an optimizer of its own)")
    if name in served.pending.adapters:
        raise ValueError(f"adapter {name!r} has forward_backward gradients not yet applied, which {what} does not "
                         "keep: call optim_step first")


def _how(served: ServedModel, name: str) -> dict:
    """How to make the adapter again: its creation arguments, or the configuration of a declared adapter."""
    if name in served.run_time.created:
        return dict(served.run_time.created[name])
    config = served.model.peft_config[name]
    targets = config.target_modules
    return {"rank": int(config.r), "alpha": float(config.lora_alpha), "seed": 0,
            "targets": targets if isinstance(targets, str) else sorted(targets), "dropout": float(config.lora_dropout)}


def save_adapter(served: ServedModel, name: str | None, path: str) -> dict:
    """Write adapter ``name``'s (None: the active adapter's) state under ``path`` (the group leader writes)."""
    name = name or served.active_adapter()
    if name is None or name not in served.adapters:
        what = "a snapshot (frozen)" if name in served.run_time.snapshots else "not an adapter"
        raise ValueError(f"{name!r} is {what} of LLM {served.llm.name!r}; its trained adapters: {served.adapters}")
    _check(served, name, "save_adapter")
    params = adapter_params(served.model, name)
    optimizer = served.adapter_steps.optimizer if served.adapter_steps is not None else None
    own = served.run_time.optimizers.get(name)  # its moments belong to its float32 masters
    optimizer, stepped = (own.optimizer, own.masters) if own is not None else (optimizer, params)
    moments = None
    if optimizer is not None:
        moments = {key: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                         for k, v in optimizer.state[p].items()}
                   for key, p in stepped.items() if p in optimizer.state}
    folder = Path(path)
    if served.role.is_group_leader:
        if folder.exists():
            raise FileExistsError(f"{folder} exists; save_adapter writes a new folder and overwrites nothing: pick "
                                  "another path")
        _write(served, name, folder, {key: p.detach().cpu().clone() for key, p in params.items()}, moments)
    return {"adapter": name, "path": str(folder), "parameters": sum(p.numel() for p in params.values()),
            "optimizer_state": moments is not None}


def _write(served: ServedModel, name: str, folder: Path, weights: dict, moments: dict | None) -> None:
    from safetensors.torch import save_file

    remove_stale_staging(folder.parent)
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    (staging / "peft").mkdir(parents=True)
    try:
        torch.save({"format": FORMAT, "adapter": name, "model": served.llm.model, "how": _how(served, name),
                    "scalings": scalings(served.model, name), "base": base_sample(served.model, name),
                    "weights": weights, "optimizer": moments},
                   staging / STATE_FILE)
        served.model.peft_config[name].save_pretrained(staging / "peft")
        save_file({k: v.contiguous() for k, v in weights.items()}, staging / "peft" / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        os.replace(staging, folder)  # whole or not at all
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # the staging folder is ours
        raise


STAGING = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>[0-9]+)")
STAGED = {STATE_FILE: None, "peft": {"adapter_config.json", "adapter_model.safetensors"}}  # what _write puts there


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders (``.<name>.partial-<pid>``) that a save killed half-way left in ``parent``: named
    so, holding nothing but what :func:`_write` writes, by a process of this host that no longer runs. Each is
    logged; returns them."""
    removed = []
    for entry in parent.iterdir() if parent.is_dir() else []:
        match = STAGING.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir() or not _staged_only(entry):
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _running(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        logger.warning("removed %s: what a save_adapter of %s killed half-way (process %d, no longer running) "
                       "left behind", entry, parent / match["name"], pid)
        removed.append(entry)
    return removed


def _staged_only(folder: Path) -> bool:
    for entry in folder.iterdir():
        if entry.name not in STAGED or entry.is_symlink():
            return False
        inside = STAGED[entry.name]
        if (inside is None) != entry.is_file():
            return False
        if inside is not None and not all(f.name in inside and f.is_file() and not f.is_symlink()
                                          for f in entry.iterdir()):
            return False
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or a number we cannot ask about): left alone
    return True


def read_state(path: str) -> dict:
    """The saved state under ``path``; raises FileNotFoundError / ValueError naming what is wrong with it."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} holds no adapter state ({STATE_FILE}); save one with save_adapter")
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")  # plain data: nothing runs
    except Exception as err:  # noqa: BLE001 - a damaged file, named (torch's long message suggests unsafe loading)
        raise ValueError(f"{file} cannot be read ({type(err).__name__}); the file is damaged or was not written by "
                         "save_adapter: save the adapter again") from None
    if not isinstance(state, dict):
        raise ValueError(f"{file} holds a {type(state).__name__}, not an adapter state; save the adapter again")
    if state.get("format") != FORMAT:
        raise ValueError(f"{file} has format {state.get('format')!r}; this llmrl reads format {FORMAT}")
    return state


def load_adapter(served: ServedModel, name: str, path: str, optimizer: bool, prefix_cache=None) -> dict:
    """Load the state under ``path`` into adapter ``name`` (created first when it does not exist), on this rank."""
    from llmrl.engine.model.training.new_adapters import create_adapter

    state = read_state(path)
    _check(served, name, "load_adapter")
    served.pending.discarded.pop(name, None)  # new weights: a note of gradients lost on the old ones no longer applies
    if optimizer and served.adapter_steps is None:
        raise ValueError(f"LLM {served.llm.name!r} holds no optimizer to load {path}'s moments into: set "
                         f"llms.{served.llm.name}.trainable: true, or load without the optimizer state")
    if optimizer and state["optimizer"] is None:
        raise ValueError(f"{path} was saved without optimizer state (by an LLM that is not trained): load it "
                         "without the optimizer state")
    if name in served.run_time.snapshots:
        raise ValueError(f"{name!r} is a snapshot of LLM {served.llm.name!r}; load into an adapter")
    check_values(state, path, optimizer)  # nothing is made or changed before the whole state is checked
    created = name not in served.adapters
    if created:
        how = state["how"]
        create_adapter(served, name, rank=how["rank"], alpha=how["alpha"], seed=how["seed"], targets=how["targets"],
                       prefix_cache=prefix_cache, dropout=how.get("dropout", 0.0))  # a declared adapter's dropout
    try:
        _copy_in(served, name, path, state, optimizer)
    except Exception:
        if created:
            from llmrl.engine.model.training.new_adapters import delete_adapter

            delete_adapter(served, name, prefix_cache)
        raise
    if prefix_cache is not None:
        prefix_cache.forget(name)
    return {"adapter": name, "path": str(path), "created": created, "optimizer_state": optimizer,
            "rank": int(served.model.peft_config[name].r)}


def scalings(model, name: str) -> dict[str, float]:
    """Each LoRA layer's scaling of adapter ``name`` (alpha / r, or alpha / sqrt(r) with rsLoRA): the factor its
    weights' product is multiplied by."""
    return {module_name: float(module.scaling[name]) for module_name, module in model.named_modules()
            if isinstance(getattr(module, "scaling", None), dict) and name in module.scaling}


def base_sample(model, name: str, modules: int = 4, values: int = 16) -> dict[str, torch.Tensor]:
    """A few values of the base weights adapter ``name`` adapts (its first ``modules`` layers, ``values`` evenly spaced
    entries of each): enough to tell the base model its weights were trained against from another model of the same
    shapes, not from a close fine-tune of it. Quantized or partitioned weights are left out, and so are weights split
    by tensor parallelism (each rank holds another part)."""
    sample = {}
    for module_name, module in model.named_modules():
        adapted = isinstance(getattr(module, "scaling", None), dict) and name in module.scaling
        base = getattr(module, "base_layer", module)
        weight = None if hasattr(base, "mp_group") else getattr(base, "weight", None)
        if len(sample) < modules and adapted and isinstance(weight, torch.Tensor) and weight.is_floating_point() \
                and weight.numel() > 0:
            flat = weight.detach().reshape(-1)
            # (float32 rounds the last index of a weight over 2**24 entries past its end: kept in bounds)
            at = torch.linspace(0, flat.numel() - 1, values).long().clamp_(max=flat.numel() - 1)
            sample[module_name] = flat[at].float().cpu()
    return sample


def _check_base(served: ServedModel, name: str, path: str, state: dict) -> None:
    """Refuse a state saved on another base model: its LoRA weights were trained against other weights. Values are
    compared to 1% (a base model served in bfloat16 rounds them); states saved without a sample are not checked."""
    here = base_sample(served.model, name)
    for key, saved in (state.get("base") or {}).items():
        if key in here and (here[key].shape != saved.shape or not torch.allclose(here[key], saved, rtol=1e-2,
                                                                                  atol=1e-6)):
            raise ValueError(f"{path} was saved from LoRA weights trained on another base model ({state.get('model')!r}"
                             f"; LLM {served.llm.name!r} serves {served.llm.model!r}): the base weights of {key} "
                             "differ. Load it on the model it was saved from")


def _copy_in(served: ServedModel, name: str, path: str, state: dict, optimizer: bool) -> None:
    params = adapter_params(served.model, name)
    weights = state["weights"]
    if set(weights) != set(params) or any(weights[k].shape != params[k].shape for k in params):
        extra, missing = sorted(set(weights) - set(params)), sorted(set(params) - set(weights))
        raise ValueError(f"{path} holds the weights of another adapter shape than {name!r} of LLM "
                         f"{served.llm.name!r} (saved but not here: {extra[:3]}; here but not saved: {missing[:3]}; "
                         "or other ranks): load it into a new adapter name, on the model it was saved from "
                         f"({state.get('model')!r})")
    saved, here = state.get("scalings"), scalings(served.model, name)  # states saved before scalings: not checked
    differ = next((k for k, v in here.items() if not abs(saved.get(k, float("nan")) - v) <= 1e-6 * abs(v)), None) \
        if saved is not None else None
    if differ is not None:
        raise ValueError(f"{path} was saved from an adapter whose LoRA scaling (alpha / r) differs from {name!r}'s "
                         f"on LLM {served.llm.name!r} ({differ}: saved {saved.get(differ)}, here {here[differ]}): its "
                         "weights would act scaled differently; load it into a new adapter name, which is made with "
                         f"the saved rank and alpha ({state.get('how')})")
    _check_base(served, name, path, state)
    steps = served.adapter_steps
    own = served.run_time.optimizers.get(name)
    if own is not None:
        check_against(state, own.masters, own.optimizer if optimizer else None, path)
    else:
        check_against(state, params, steps.optimizer if optimizer and steps is not None else None, path)
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(weights[key].to(p.device, p.dtype))
    if own is not None:
        own.reset()  # masters from the loaded weights, fresh moments
        for key, master in own.masters.items():
            saved = (state["optimizer"] or {}).get(key)
            if optimizer and saved:
                own.optimizer.state[master] = {k: loaded(v, k, master.device) for k, v in saved.items()}
        return
    if steps is None:
        return
    for key, p in params.items():
        steps.optimizer.state.pop(p, None)  # fresh moments, unless the saved ones are asked for
        saved = (state["optimizer"] or {}).get(key)
        if optimizer and saved:
            steps.optimizer.state[p] = {k: loaded(v, k, p.device) for k, v in saved.items()}

