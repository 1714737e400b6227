"""Where things are in a checkpoint folder written by ``Caller.save``: shared by the client (which swaps
checkpoints into place), the servers (which write and read them) and the config check (``checkpoint:``).

A checkpoint is complete when its manifest (``llmrl-checkpoint.json``) exists; each LLM has a folder
``<llm>/`` with ``deepspeed/``, ``state/`` and ``export/``. A save that was interrupted between the two
renames of its swap leaves the previous checkpoint as a ``.<name>.old-*`` sibling, which is found here.

This module names things and writes small files durably (:func:`write_json`, :func:`fsync_dir`); it imports
nothing heavy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "llmrl-checkpoint.json"
TAG = "llmrl"


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
