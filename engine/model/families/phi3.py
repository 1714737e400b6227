"""The Phi-3 family (``model_type`` ``phi3``): a plain output layer (its packed projections keep it out of the
written-out decode step). Registers its record; it loads no model."""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, register

PHI3 = register(Family(name="Phi-3", model_types=("phi3",), plain_output=True))
