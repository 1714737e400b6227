"""Ranks 1..N-1: serving requests in order (``serve``), this rank's replica and its start-up (``replica``),
the LLM's own world and the votes that keep its ranks in step (``group``)."""
