"""MkDocs hook (mkdocs.yml's ``hooks``): lets mkdocstrings find the ``llmrl`` package from the source tree.

The repository root is the package ``llmrl`` (pyproject.toml's ``package-dir``), so no folder named ``llmrl`` exists
for griffe to find; it falls back to importing the installed (editable) package. When ``mkdocs`` runs as the
console script, its folder (``.venv/bin``) comes first on ``sys.path`` and holds the ``llmrl`` console script, which
griffe would take for the package: this hook takes such folders off the search path. It changes nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path


def on_startup(command: str, dirty: bool) -> None:
    sys.path[:] = [entry for entry in sys.path if not (entry and Path(entry, "llmrl").is_file())]
