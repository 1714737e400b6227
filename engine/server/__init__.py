"""Ranks 1..N-1: serving requests in order (``serve``), this rank's replica and its start-up (``replica``),
the LLM's own world and the votes that keep its ranks in step (``group``). No model
code lives here: a request reaches the model through its kind's handler (:mod:`llmrl.engine.requests`) and the
backend (:mod:`llmrl.engine.model`)."""
