"""Durable file operations: what a manifest, a checkpoint or a cache entry vouches for is on disk first.

This module writes and flushes files; it knows nothing about what they hold.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON and flush it to disk before returning."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    """Flush a file's content to disk (nothing happens for a path that is not a file)."""
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


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk, where the filesystem allows it."""
    fsync_file(path)


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))
