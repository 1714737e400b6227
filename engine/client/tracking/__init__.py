"""Experiment tracking on the client: the scalars of a run (each update's statistics, the servers' memory and
cache, the script's own) written to CSV, TensorBoard, trackio, Weights & Biases (offline) or MLflow (a local file
store). ``scalars`` computes them, ``backends`` holds one writer per tool, ``tracker`` names the run, counts its
steps and dispatches; the Caller's side is :mod:`llmrl.engine.client.tracking_calls`.

This package re-exports; importing it imports no back end's package.
"""

from __future__ import annotations

from llmrl.engine.client.tracking.backends import BACKENDS, BackendMissing
from llmrl.engine.client.tracking.tracker import Tracker, config_params

__all__ = ["BACKENDS", "BackendMissing", "Tracker", "config_params"]
