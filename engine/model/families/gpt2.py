"""The GPT-2 family: GPT-2 (``gpt2``: a plain output layer) and its descendant GPT-BigCode (``gpt_bigcode``,
StarCoder 1). DeepSpeed AutoTP shards neither; their layers sit in ``transformer.h``, where the frozen trunk does
not look. Registers their records; it loads no model."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, register

GPT2 = register(Family(name="GPT-2", model_types=("gpt2",), plain_output=True, trunk_layers=None, autotp=False))
GPT_BIGCODE = register(Family(name="GPT-BigCode", model_types=("gpt_bigcode",), trunk_layers=None, autotp=False))
