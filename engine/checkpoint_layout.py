"""Where things are in a checkpoint folder written by ``Caller.save``: shared by the client (which swaps
checkpoints into place), the servers (which write and read them) and the config check (``checkpoint:``).

A checkpoint is complete when its manifest (``llmrl-checkpoint.json``) exists; it lists every entry of the
folder (so that nothing else is ever replaced by a save) and the time of the save. Each LLM has a folder
``<llm>/`` with ``deepspeed/``, ``state/`` and ``export/``. A save that was interrupted between the two
renames of its swap leaves the previous checkpoint as a ``.<name>.old-*`` sibling: :func:`resolve_checkpoint`
finds the newest complete one by the time its manifest records, so a run can resume from it.

This module names things, reads manifests and writes small files durably; it imports nothing heavy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "llmrl-checkpoint.json"
TAG = "llmrl"


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a complete checkpoint, or None."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def backups_of(path: Path) -> list[Path]:
    """Complete checkpoints left next to ``path`` by interrupted swaps, newest save first (by manifest time)."""
    found = [(read_manifest(p), p) for p in path.parent.glob(f".{path.name}.old-*") if p.is_dir()]
    return [p for manifest, p in sorted(((m, p) for m, p in found if m), key=lambda mp: -float(mp[0].get("time", 0)))]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint at ``path``, or the newest one an interrupted swap left beside it."""
    path = Path(path).expanduser()
    if read_manifest(path) is not None:
        return path
    backups = backups_of(path)
    if backups:
        return backups[0]
    raise FileNotFoundError(f"no complete llmrl checkpoint at {path} (a folder written by Caller.save has {MANIFEST})")


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON and flush it to disk before returning."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk, where the filesystem allows it."""
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


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` to disk (what a manifest vouches for must be there first)."""
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        fsync_dir(Path(folder))
