"""Plugins the benchmark's servers load to recreate a baseline (``"benchmarks.hooks:Name"`` in a config's
``initializers``); the servers import them from the repository root, the folder the benchmark runs in.

Benchmark code only: no test or shipped code uses them, and they change no model weights.
"""

from __future__ import annotations

from llmrl.plugins.contracts import Initializer


class EveryTwinComputed(Initializer):
    """Benchmark baseline hook, applied by monkeypatching on the server (each LLM's servers are processes of their
    own): twin contexts (same ids, same candidates) are computed once per copy, as before the engine recognised
    them. Leaves the model untouched."""

    def initialize(self, model, llm):
        from llmrl.engine.model import forward

        forward.distinct_contexts = lambda plan: (None, None)
        return model


class LogitsKeptWhole(Initializer):
    """Benchmark baseline hook: every pass keeps its full-vocabulary logits, as llmrl did before passes with gradients
    read log-probs from hidden states in chunks and before passes without gradients normalised pieces of rows.
    Leaves the model untouched."""

    def initialize(self, model, llm):
        from llmrl.engine.model import module
        from llmrl.engine.model.scoring import results

        module.applies = lambda *args, **kwargs: False
        results.LOGITS_PER_PIECE = 1 << 62
        return model
