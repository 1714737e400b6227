"""Environments and tasks from other libraries, for reward loops and evaluation: reasoning-gym datasets as tasks
(:class:`ReasoningGymTask`) and the task protocol the evaluation harness takes (:class:`EvalTask`,
:class:`FunctionTask`).

This package only re-exports, lazily: importing it imports no environment library.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EvalTask": "llmrl.engine.envs.eval_task",
    "FunctionTask": "llmrl.engine.envs.eval_task",
    "ReasoningGymTask": "llmrl.engine.envs.reasoning_gym_tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
