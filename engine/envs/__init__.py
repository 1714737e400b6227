"""Environments and tasks from other libraries, for reward loops and evaluation: reasoning-gym datasets as tasks
(:class:`ReasoningGymTask`), the task protocol the evaluation harness takes (:class:`EvalTask`,
:class:`FunctionTask`), verifiers tasks played through the OpenAI endpoint (:mod:`.verifiers_env`) and OpenEnv
clients as ``run_episodes`` environments (:mod:`.openenv_env`; import those two from their modules).

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
