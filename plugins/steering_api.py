"""The contract of an updater's ``steering`` hook (``generate(..., steer=...)``): :class:`SteeringView`, what the hook
receives, and :func:`steering_processor`, how the engine calls the hook and checks the request's options against it.

Part of the plugin API the engine may import (with :mod:`llmrl.plugins.contracts` and :mod:`llmrl.plugins.registry`);
the built-in processors, taps and their maths are :mod:`llmrl.plugins.steering`'s, which re-exports these names. It
runs no model and builds no view (:mod:`llmrl.engine.model.steered` does).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LogitsProcessor


@dataclass
class SteeringView:
    """What ``Updater.steering`` receives."""

    model: Any  # the served model (a PeftModel with LoRA adapters)
    kind: str  # "causal" or "seq2seq"
    heads: dict  # head modules by key
    tokenizer: Any
    adapter: Callable[[str | None], contextlib.AbstractContextManager]  # run with this adapter or snapshot active
    has_snapshot: Callable[[str], bool]
    snapshot: Callable[[str, str | None], None]  # take snapshot ``name`` of adapter ``source`` (None: the active)
    policy_adapter: str | None = None  # the adapter the request generates with (None: the active one)
    cache_argument: str = "past_key_values"  # the model's key/value cache argument ("cache" from transformers 5.24)

    @property
    def base(self):
        """The transformers model under the PEFT wrapper (what ``generate`` calls at each step)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model


def steering_processor(updater, view: SteeringView, steer) -> LogitsProcessor:
    """The processor of ``generate(..., steer=...)``: ``steer`` is True or a dict of the updater's steering options.
    Raises ValueError naming what is wrong (no updater, an updater without a steered policy, a bad option)."""
    if updater is None or not callable(getattr(updater, "steering", None)):
        name = type(updater).__name__ if updater is not None else "none"
        raise ValueError(f"steer samples from the updater's own policy, but this LLM's updater ({name}) defines "
                         "none; nlpo and ilql do (updater.plugin), or leave steer out")
    if steer is True:
        options = {}
    elif isinstance(steer, dict):
        options = dict(steer)
    else:
        raise ValueError(f"steer must be true or a dict of the updater's steering options, got {steer!r}")
    try:  # the options are checked against the hook's signature (a TypeError inside the hook stays one)
        inspect.signature(updater.steering).bind(view, **options)
    except TypeError as err:
        raise ValueError(f"steer={steer!r}: {err}; the updater's steering options: "
                         f"{list(inspect.signature(updater.steering).parameters)[1:]}") from None
    return updater.steering(view, **options)
