"""Plugins: the contracts (Head, Initializer, Updater), their discovery, and the built-in plugins.

Re-exports only, resolved lazily so that naming a plugin does not import torch before it is needed.
"""

from __future__ import annotations

__all__ = ["Head", "Initializer", "Updater", "ShufflingUpdater", "Trainer", "UpdateBatch", "ForwardOutputs", "LLMInfo"]


def __getattr__(name: str):
    if name in __all__:
        from llmrl.plugins import contracts

        return getattr(contracts, name)
    raise AttributeError(f"module 'llmrl.plugins' has no attribute {name!r}")
