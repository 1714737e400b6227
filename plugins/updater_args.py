"""The config arguments the built-in updaters share, each with one JSON schema, so that ``epochs`` or ``clip_eps``
is checked the same way in ``ppo``, ``ppo_tokens``, ``grpo`` and ``pairwise_reward``.

:func:`updater_schema` builds an updater's ``args_schema``: closed (an unknown key is an error naming it), made of
the shared arguments it names and its own. Defaults and meanings stay in each updater's docstring and
constructor; this module only says what values are allowed. It does not check anything itself
(:func:`llmrl.plugins.checks.args_problem` does).
"""

from __future__ import annotations

SHARED_ARGS: dict[str, dict] = {
    "epochs": {"type": "integer", "minimum": 1},
    "clip_eps": {"type": "number", "exclusiveMinimum": 0},
    "clip_eps_high": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "value_clip": {"type": ["number", "null"], "exclusiveMinimum": 0},
    "value_coef": {"type": "number", "minimum": 0},
    "entropy_coef": {"type": "number"},
    "kl_coef": {"type": "number", "minimum": 0},
    "value_head": {"type": ["string", "null"]},
    "peft_adapter": {"type": ["string", "null"]},
    "seed": {"type": "integer"},
}


def updater_schema(*shared: str, **own: dict) -> dict:
    """A closed JSON schema of the ``shared`` arguments (names in :data:`SHARED_ARGS`) and the updater's ``own``."""
    unknown = [name for name in shared if name not in SHARED_ARGS]
    if unknown:
        raise KeyError(f"no shared updater argument {unknown}; shared ones: {sorted(SHARED_ARGS)}")
    return {"type": "object", "additionalProperties": False,
            "properties": {**{name: SHARED_ARGS[name] for name in shared}, **own}}
