"""Experiment tracking on the client: the scalars of a run (each update's statistics, the servers' memory and
cache, the script's own) written to CSV, TensorBoard, trackio, Weights & Biases (offline), MLflow (a local file
store) or a back end another package registers. ``scalars`` computes them, ``protocol`` says what a back end is,
``registry`` names the back ends (built-in and from the entry-point group ``llmrl.trackers``), ``backends`` holds
the built-in writers, ``tracker`` names the run, counts its steps and dispatches; the Caller's side is
:mod:`llmrl.engine.client.tracking_calls`.

This package re-exports; importing it imports no back end's package.
"""

from __future__ import annotations

from llmrl.engine.client.tracking.protocol import TrackerBackend
from llmrl.engine.client.tracking.registry import GROUP, BackendMissing, available, open_backend
from llmrl.engine.client.tracking.tracker import Tracker, config_params

__all__ = ["GROUP", "BackendMissing", "Tracker", "TrackerBackend", "available", "config_params", "open_backend"]
