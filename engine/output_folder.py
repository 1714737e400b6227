"""An example's output folder (``--out``), claimed before the run: the files an example writes there (its curve,
metrics and summary) may replace only files that llmrl's examples wrote, never a user's own.

A hidden marker file in the folder (:data:`MARKER`) lists the names llmrl's examples wrote there. A file of one of
those names that exists but is not listed is the user's: the run stops before it starts, naming it. Files of other
names are never touched. This module checks and records; the examples write their files themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = ".llmrl-outputs"
EXAMPLE_OUTPUTS = ("curve.png", "metrics.csv", "summary.json")


def claim_output_folder(folder: str, names: tuple[str, ...] = EXAMPLE_OUTPUTS) -> Path:
    """Create ``folder`` if missing and record ``names`` as llmrl's there; raises SystemExit (a one-line reason)
    if one of ``names`` is there already and llmrl did not write it, or if ``folder`` is not a folder."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"llmrl: the output folder {folder} is a file; name a folder (--out)")
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER
    try:
        ours = set(json.loads(marker.read_text())) if marker.is_file() else set()
    except (OSError, ValueError, TypeError):
        ours = set()
    theirs = [name for name in names if (path / name).exists() and name not in ours]
    if theirs:
        raise SystemExit(f"llmrl: {path / theirs[0]} exists and was not written by an llmrl example: it is not "
                         "overwritten; choose another --out, or move the file away")
    marker.write_text(json.dumps(sorted(ours | set(names))))
    return path
