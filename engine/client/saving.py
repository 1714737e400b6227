"""``Caller.save``: write a checkpoint of every LLM atomically, never replacing anything that is not one.

The servers write into a staging folder next to the target (the ``save`` request kind) and flush what they
wrote to disk; only then does the client write the manifest (which lists every entry of the checkpoint) and
swap the staging folder into place with two renames. An interrupted save never leaves a half checkpoint where
a good one was: until the new one is complete the target holds the previous one, and a crash between the two
renames leaves the previous one as a ``.<name>.old-*`` sibling, which a run can resume from
(:func:`~llmrl.engine.checkpoint_layout.resolve_checkpoint`) and the next save removes. A target that holds
anything else (a folder of your files, a checkpoint next to which you put a file) is refused. On multi-node runs
the target must be on a filesystem every node sees.

This module handles folders; what goes in them is :mod:`llmrl.engine.model.checkpoint`'s.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import time
import uuid
from pathlib import Path

from llmrl.engine.checkpoint_layout import MANIFEST, backups_of, read_manifest, resolve_checkpoint
from llmrl.engine.client.client_state import check_client_state, read_client_state, write_client_state
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.files import fsync_dir, write_json
from llmrl.engine.requests import save

FORMAT = 2


def generate_seeds(config) -> random.Random:
    """The client's generator of the seeds of ``generate`` calls made without one: seeded by the config, or, when an
    LLM resumes from a checkpoint, as that checkpoint's save left it (the resumed run's samples are then those the
    saved run would have drawn next, not its first ones again)."""
    seeds = random.Random(config.seed)
    saved = _resumed(config, "generate_seeds")
    if saved:
        seeds.setstate((saved[0], tuple(saved[1]), saved[2]))
    return seeds


def resumed_tracking(config) -> dict | None:
    """The tracking position (:meth:`~llmrl.engine.client.tracking.Tracker.position`) of the checkpoint an LLM
    resumes from, or None."""
    return _resumed(config, "tracking")


def resumed_client_state(config):
    """The ``client_state`` saved in the checkpoint an LLM resumes from (the first LLM whose checkpoint holds one),
    or None (see :mod:`llmrl.engine.client.client_state`)."""
    for llm in config.llms.values():
        if llm.checkpoint:
            state = read_client_state(resolve_checkpoint(llm.checkpoint))
            if state is not None:
                return state
    return None


def _resumed(config, key: str):
    """Entry ``key`` of the manifest of the first checkpoint an LLM resumes from that holds it, or None."""
    for llm in config.llms.values():
        saved = (read_manifest(resolve_checkpoint(llm.checkpoint)) or {}).get(key) if llm.checkpoint else None
        if saved:
            return saved
    return None


def save_run(run, wait, path: str, seeds: random.Random | None = None, tracking: dict | None = None,
             client_state=None) -> str:
    """Write a checkpoint of every LLM of ``run`` to ``path`` atomically; ``wait(future)`` waits for the servers;
    ``seeds``: the client's :func:`generate_seeds`, kept in the manifest, as ``tracking`` (the tracker's steps);
    ``client_state``: the script's own state, saved beside (None: none). Returns the absolute path."""
    target = Path(path).expanduser().resolve()
    if client_state is not None:
        check_client_state(client_state)  # refused before anything is written
    check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.staging-*"):  # [ ] * ? in a name: literal
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that was interrupted
    save_id = uuid.uuid4().hex[:12]
    staging = target.parent / f".{target.name}.staging-{save_id}"
    staging.mkdir()
    try:
        wait(save.send(run, str(staging)))
        if client_state is not None:
            write_client_state(staging, client_state)
        config = run.config
        entries = sorted([*os.listdir(staging), MANIFEST])
        manifest = {"format": FORMAT, "id": save_id, "time": time.time(), "llms": list(config.llms),
                    "entries": entries, "files": sorted([*files_under(staging), MANIFEST]),
                    "layout": {name: {"replicas": llm.replicas, "tensor_parallel": llm.tensor_parallel,
                                      "zero_stage": llm.training.zero_stage,
                                      "optimizer": llm.training.optimizer.type}
                               for name, llm in config.llms.items()},
                    **({"generate_seeds": seeds.getstate()} if seeds is not None else {}),
                    **({"tracking": tracking} if tracking is not None else {})}
        write_json(staging / MANIFEST, manifest)
        fsync_dir(staging)
        swap_into_place(staging, target, save_id)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(target)


def swap_into_place(staging: Path, target: Path, save_id: str) -> None:
    """Rename ``staging`` to ``target``; a checkpoint already there is moved aside first and removed after."""
    backup = None
    if target.exists():
        backup = target.parent / f".{target.name}.old-{save_id}"
        os.rename(target, backup)
    os.rename(staging, target)
    fsync_dir(target.parent)
    for old in [*([backup] if backup else []), *backups_of(target)]:
        shutil.rmtree(old, ignore_errors=True)  # ours: named by a save and vouched for by a manifest


def check_replaceable(target: Path) -> None:
    """Refuse a target that a save would destroy: anything but nothing, an empty folder, or an llmrl checkpoint
    holding exactly what its manifest lists."""
    if not target.exists():
        return
    if not target.is_dir():
        raise InvalidArgument(f"cannot save a checkpoint to {target}: it is a file, not a folder; pick another path")
    contents = sorted(os.listdir(target))
    if not contents:
        return
    manifest = read_manifest(target)
    if manifest is None:
        raise InvalidArgument(f"refusing to save a checkpoint to {target}: it is not empty and not an llmrl "
                              f"checkpoint (it holds {_some(contents)}); a save replaces its target whole, so pick a "
                              "new folder, e.g. a subfolder such as runs/exp/checkpoint")
    listed = set(manifest.get("entries") or [*manifest.get("llms", []), MANIFEST])
    foreign = [name for name in contents if name not in listed]
    if not foreign and "files" in manifest:  # a file put inside one of its folders would go too
        written = set(manifest["files"])
        foreign = [name for name in files_under(target) if name not in written]
    if foreign:
        raise InvalidArgument(f"refusing to replace the checkpoint {target}: it also holds {_some(foreign)}, which "
                              "the checkpoint did not write and a save would delete; move them out first")


def files_under(folder: Path) -> list[str]:
    """Every file (or link) below ``folder``, as a path relative to it with ``/`` separators, sorted."""
    out = []
    for root, dirs, files in os.walk(folder):
        relative = Path(root).relative_to(folder)
        out += [(relative / name).as_posix() for name in files]
        out += [(relative / name).as_posix() for name in dirs if os.path.islink(os.path.join(root, name))]
    return sorted(out)


def _some(names: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
