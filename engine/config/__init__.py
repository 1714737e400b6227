"""A run's configuration: one YAML file, validated against a JSON Schema, turned into frozen typed objects.

``schema.json`` describes every key and holds its default, ``reference`` reads it (for the typed objects, the
checks, ``llmrl validate --resolved`` and the reference page), ``types`` holds the objects, ``loading`` reads,
overrides, validates and builds, ``checks`` holds the checks the schema cannot express, ``topology`` computes every
rank's role from the config alone. This package re-exports what the rest of llmrl uses; importing it loads nothing
heavy.
"""

from __future__ import annotations

from llmrl.engine.config.checks import BUILTIN_MODEL_PREFIX, world_size_problem
from llmrl.engine.config.loading import load_config
from llmrl.engine.config.types import (
    Config,
    LLMConfig,
    OptimizerConfig,
    PluginSpec,
    QuantizationConfig,
    Timeouts,
    TrackingConfig,
    TrainingConfig,
)

__all__ = ["BUILTIN_MODEL_PREFIX", "Config", "LLMConfig", "OptimizerConfig", "PluginSpec", "QuantizationConfig",
           "Timeouts", "TrackingConfig", "TrainingConfig", "load_config", "world_size_problem"]
