"""The T5 family: T5 (``t5``: a plain output layer, after the decoder's output scaling that
:mod:`~llmrl.engine.model.scoring.context_logits` applies) and mT5, UMT5 and LongT5. All have relative positions
(no position table: their ``n_positions`` is no input limit) and no decoder-only layer list for the frozen trunk.
Registers their records; it loads no model."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, register

T5 = register(Family(name="T5", model_types=("t5",), plain_output=True, trunk_layers=None, relative_positions=True))
T5_VARIANTS = register(Family(name="mT5, UMT5, LongT5", model_types=("mt5", "umt5", "longt5"), trunk_layers=None,
                              relative_positions=True))
