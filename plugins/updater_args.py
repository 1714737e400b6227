"""The config arguments the built-in updaters share, each with one JSON schema, so that ``epochs`` or ``clip_eps``
is checked the same way in ``ppo``, ``ppo_tokens``, ``grpo`` and ``pairwise_reward``.

:func:`updater_schema` builds an updater's ``args_schema``: closed (an unknown key is an error naming it), made of
the shared arguments it names and its own, each with the allowed values and a ``description`` (the shared ones'
from :data:`SHARED_DESCRIPTIONS`, which an updater may reword with :func:`describe`; the reference page of the
built-in plugins and ``llmrl plugins --args NAME`` show them). Defaults stay in each updater's constructor; this
module only says what values are allowed and what they mean. It does not check anything itself
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
    # the enums are rl_math's MODES, LEVELS (off_policy.py) and KL_ESTIMATORS (kl.py); a test checks they agree
    "off_policy": {"type": ["object", "null"], "additionalProperties": False,
                   "properties": {"mode": {"enum": ["none", "tis", "mis", "icepop"]},
                                  "level": {"enum": ["token", "sequence", "geometric"]},
                                  "low": {"type": "number", "minimum": 0},
                                  "high": {"type": "number", "exclusiveMinimum": 0}}},
    "kl_estimator": {"enum": ["k1", "k2", "k3"]},
}

# ``entropy_coef`` of the token-level policy updaters: a number, or a linear schedule over updates
# (:class:`llmrl.plugins.rl_math.variants.EntropySchedule`); an updater passes it as its own ``entropy_coef``.
SCHEDULED_ENTROPY_COEF = {
    "oneOf": [{"type": "number"},
              {"type": "object", "additionalProperties": False, "required": ["start", "end", "updates"],
               "properties": {"start": {"type": "number"}, "end": {"type": "number"},
                              "updates": {"type": "integer", "minimum": 1}}}],
    "description": "weight of the entropy bonus: a number, or {start, end, updates}: linear from start to end over "
                   "that many updates, then end",
}

SHARED_DESCRIPTIONS: dict[str, str] = {
    "epochs": "passes over the batch per update",
    "clip_eps": "policy ratio clip",
    "clip_eps_high": "the upper ratio clip, when it differs from clip_eps (null: clip_eps)",
    "value_clip": "value clip around the values at collection time (null disables)",
    "value_coef": "weight of the value loss",
    "entropy_coef": "weight of the entropy bonus",
    "kl_coef": "weight of the KL term to the reference (0 skips the reference pass)",
    "value_head": "the head key giving the values (null: no critic)",
    "peft_adapter": "the LoRA adapter to train (null: the active one)",
    "seed": "seed of the minibatch shuffling",
    "off_policy": "importance-sampling correction from behaviour_logprobs (the sampler's) to the old log-probs: "
                  "{mode: none | tis | mis | icepop, level: token | sequence | geometric, low, high}; tis truncates "
                  "the weight at high (default 2), mis masks weights outside [low, high] (defaults 0 and 2), icepop "
                  "likewise with [0.5, 5] (null: none)",
    "kl_estimator": "the per-token KL estimator to the reference: k1 (logprob - ref), k2 ((logprob - ref)^2 / 2) or "
                    "k3 (exp(ref - logprob) - (ref - logprob) - 1)",
}


def updater_schema(*shared: str, **own: dict) -> dict:
    """A closed JSON schema of the ``shared`` arguments (names in :data:`SHARED_ARGS`, with their shared
    descriptions) and the updater's ``own``; each property is a copy, so :func:`describe` changes one schema only."""
    unknown = [name for name in shared if name not in SHARED_ARGS]
    if unknown:
        raise KeyError(f"no shared updater argument {unknown}; shared ones: {sorted(SHARED_ARGS)}")
    properties = {**{name: {**SHARED_ARGS[name], "description": SHARED_DESCRIPTIONS[name]} for name in shared},
                  **{name: dict(spec) for name, spec in own.items()}}
    return {"type": "object", "additionalProperties": False, "properties": properties}


def describe(schema: dict, **descriptions: str) -> None:
    """Set the ``description`` of arguments of ``schema`` (an updater's own, or a shared one reworded for it)."""
    for name, text in descriptions.items():
        if name not in schema["properties"]:
            raise KeyError(f"described argument {name!r} is not in the schema")
        schema["properties"][name]["description"] = text
