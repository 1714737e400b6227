"""An installed distribution written into a folder (its ``*.dist-info`` with ``METADATA`` and ``entry_points.txt``),
for the tests of entry-point discovery: put the folder on ``sys.path`` and ``importlib.metadata`` finds it. It writes
the metadata only; the modules the entry points name are the caller's to write. Test code, never shipped."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_distribution(root: Path, name: str, entry_points: str) -> Path:
    """``root/<name>-1.0.dist-info`` declaring ``entry_points`` (the ``[group]`` / ``name = module:attr`` text)."""
    dist = Path(root) / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return dist
