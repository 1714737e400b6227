"""The models whose attention adds ALiBi position biases, by ``model_type``: MPT and Bloom (Falcon only with its
config's ``alibi``, read from the config itself). The bias is built from column indices, so packed rows would give
each segment the wrong distances (:mod:`~llmrl.engine.model.attention_span`). Registers their record; it loads no
model."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, register

ALIBI = register(Family(name="ALiBi (MPT, Bloom)", model_types=("mpt", "bloom"), alibi=True))
