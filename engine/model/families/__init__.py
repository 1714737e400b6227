"""Model families: what llmrl knows of particular Hugging Face model types, one module per family.

:mod:`.registry` holds the :class:`~.registry.Family` record and the lookups (:func:`family_of`,
:func:`model_types_where`, :func:`step_families`); each other module registers the record(s) of one family:
``llama.py``, ``mistral.py``, ``qwen2.py`` (Qwen2, Qwen2-MoE), ``qwen3.py`` (Qwen3, Qwen3-MoE), ``phi3.py`` (the
written-out step through packed projections), ``gpt2.py`` (GPT-2, GPT-BigCode), ``t5.py`` (T5, mT5, UMT5, LongT5),
``recurrent.py`` (state outside attention), ``alibi.py`` (MPT, Bloom). The decode step, the sliding-window and
whole-context checks, the chunked vocabulary, the logits after a context, the frozen trunk and the config checks
read these records, never a list of their own.

Adding a family: write ``families/<name>.py`` registering a ``Family`` with its model types and facts (for the
written-out decode step, a ``step_classes`` function importing its Hugging Face classes: a Llama-shaped layout, and
a ``step_projections`` function where its projections are packed, as ``phi3.py`` does), and name the module once in
the import below; then add its model type to tests/test_model_families.py. A model type no family claims gets
:data:`~.registry.DEFAULT`'s facts. This package loads no model and imports no torch.
"""

from __future__ import annotations

from llmrl.engine.model.families.registry import (
    DEFAULT,
    Family,
    StepClasses,
    families,
    family_of,
    model_type_of,
    model_types_where,
    register,
    step_families,
    unregister,
)

# Each module registers its family on import, in this order (the order messages list them in): name a new one here.
# isort: off
from llmrl.engine.model.families import llama, mistral, qwen2, qwen3, phi3, gpt2, t5, recurrent, alibi  # noqa: F401
# isort: on

__all__ = ["DEFAULT", "Family", "StepClasses", "families", "family_of", "model_type_of", "model_types_where",
           "register", "step_families", "unregister"]
