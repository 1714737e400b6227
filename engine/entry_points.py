"""The entry points of one group that installed packages declare, read once per process and ``sys.path``.

``importlib.metadata.entry_points(group=...)`` reads the metadata of every installed distribution on each call
(about 15 ms with 270 packages on a 2-core AMD EPYC, 2026-12-02). A config names several plugins per LLM and every
rank checks the config, so the plain calls cost a rank up to a second of CPU before it did any work. Here a group
is read once and kept while ``sys.path`` stays the same (a folder added to it, such as the RL script's on a server,
or a test's distribution, is read at the next call). A package installed into an existing folder while the process
runs is not seen: start the process again.

This module reads metadata; it imports no entry point (its callers do).
"""

from __future__ import annotations

import importlib.metadata
import sys

_read: dict[str, tuple[tuple[str, ...], tuple[importlib.metadata.EntryPoint, ...]]] = {}  # group -> (sys.path, eps)


def entry_points(group: str, name: str | None = None) -> list[importlib.metadata.EntryPoint]:
    """What ``importlib.metadata.entry_points(group=group)`` returns (those named ``name`` when given), in its
    order, from this process's reading of ``group`` under the current ``sys.path``."""
    path = tuple(sys.path)
    known = _read.get(group)
    if known is None or known[0] != path:
        known = _read[group] = (path, tuple(importlib.metadata.entry_points(group=group)))
    return [ep for ep in known[1] if name is None or ep.name == name]
