"""Where things are in a checkpoint folder written by ``Caller.save``: shared by the client (which swaps
checkpoints into place), the servers (which write and read them) and the config check (``checkpoint:``).

A checkpoint is complete when its manifest (``llmrl-checkpoint.json``) exists; it lists every entry of the
folder (so that nothing else is ever replaced by a save) and the time of the save. Each LLM has a folder
``<llm>/`` with ``deepspeed/``, ``state/`` and ``export/``. A save that was interrupted between the two
renames of its swap leaves the previous checkpoint as a ``.<name>.old-*`` sibling: :func:`resolve_checkpoint`
finds the newest complete one by the time its manifest records, so a run can resume from it.

This module names things and reads manifests; it writes nothing and imports nothing heavy.
"""

from __future__ import annotations

import glob
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
    found = [(read_manifest(p), p) for p in path.parent.glob(f".{glob.escape(path.name)}.old-*") if p.is_dir()]
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
