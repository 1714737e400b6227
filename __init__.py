"""llmrl: Hugging Face language models as the policies, critics and reward models of RL agents.

Your RL script is the client: it creates a :class:`Caller` and asks the model servers to
``score`` candidate actions, ``generate`` text, run ``custom_module_fns`` (heads) and
``update`` themselves. The servers are the other ranks of a DeepSpeed launch.

This module only re-exports. It is deliberately light: importing it loads neither torch,
deepspeed nor transformers; they are imported where they are used.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "Caller",
    "completion_datum",
    "Trajectory",
    "Episode",
    "run_episodes",
    "group_episode_advantages",
    "episode_batch",
    "openai_endpoint",
    "AsyncRollouts",
    "overlong_penalty",
    "keep_varied_groups",
    "correct_datums",
    "LLMRLError",
    "ConfigError",
    "PluginError",
    "RequestError",
    "InvalidArgument",
    "InvalidArgumentType",
    "ServerDiedError",
    "RequestTimeoutError",
    "LLMClosedError",
    "__version__",
]

_LAZY = {
    "Caller": "llmrl.engine.client.caller",
    "completion_datum": "llmrl.engine.requests.datums",
    "Trajectory": "llmrl.engine.client.trajectory",
    "Episode": "llmrl.engine.client.episodes",
    "run_episodes": "llmrl.engine.client.episodes",
    "group_episode_advantages": "llmrl.engine.client.episodes",
    "episode_batch": "llmrl.engine.client.episodes",
    "openai_endpoint": "llmrl.engine.openai_api.endpoint",
    "AsyncRollouts": "llmrl.engine.client.async_rollouts",
    "overlong_penalty": "llmrl.plugins.rl_math.dapo",  # DAPO's helpers and the off-policy correction of datums
    "keep_varied_groups": "llmrl.plugins.rl_math.dapo",
    "correct_datums": "llmrl.plugins.rl_math.off_policy",
    "LLMRLError": "llmrl.engine.errors",
    "ConfigError": "llmrl.engine.errors",
    "PluginError": "llmrl.engine.errors",
    "RequestError": "llmrl.engine.errors",
    "InvalidArgument": "llmrl.engine.errors",
    "InvalidArgumentType": "llmrl.engine.errors",
    "ServerDiedError": "llmrl.engine.errors",
    "RequestTimeoutError": "llmrl.engine.errors",
    "LLMClosedError": "llmrl.engine.errors",
}


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'llmrl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
