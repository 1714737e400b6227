"""The ``llmrl`` logger: one standard :mod:`logging` logger for the whole library, configured once per process.

Every rank logs to stderr with a prefix naming it (``llmrl:`` on the client, ``llmrl rank N:`` on a
server). ``log_level`` in the config sets the level for llmrl's own messages; at ``debug`` every rank
logs one line per request (its kind, sizes and time). Warnings and errors of the engine go through it.

This module does not quiet other libraries; the server does that for DeepSpeed and transformers.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("llmrl")


def configure(level: str = "info", rank: int | None = None) -> logging.Logger:
    """Send llmrl's messages to stderr at ``level``, prefixed with the rank (None: the client)."""
    prefix = "llmrl" if rank is None or rank == 0 else f"llmrl rank {rank}"
    for handler in list(logger.handlers):
        if getattr(handler, "_llmrl", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    handler._llmrl = True
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger
