"""The processor of a ``generate(..., steer=...)`` request: the view of the served model that an updater's
``steering`` hook receives (:class:`~llmrl.plugins.steering_api.SteeringView`), built here, and the hook's processor.

It decides nothing about the policy (the updater does) and runs no model.
"""

from __future__ import annotations

from llmrl.engine.model.reuse.hf_kv import cache_kwarg
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.snapshots import take_snapshot


def steering_for(served: ServedModel, prefix_cache, steer, adapter: str | None):
    """The LogitsProcessor of the LLM's updater for ``steer`` (True or a dict of options); raises ValueError naming
    what is wrong (no steering updater, a bad option, ZeRO-3)."""
    from llmrl.plugins.steering_api import SteeringView, steering_processor

    if served.llm.lockstep:
        raise ValueError("steer needs ZeRO 0-2: under ZeRO-3 the heads and snapshots it reads are partitioned")
    view = SteeringView(served.model, served.llm.type, dict(served.module.heads), served.tokenizer, served.adapter,
                        served.run_time.is_snapshot,
                        lambda name, source: take_snapshot(served, name, source, prefix_cache), adapter,
                        cache_kwarg(served.model))
    return steering_processor(served.updater, view, steer)
