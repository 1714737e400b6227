"""The test kit: what tests (and the benchmark) share. Not installed with llmrl."""

from testkit.compare import assert_same_training
from testkit.live import LiveRun
from testkit.models import reference_scores, tiny_model

__all__ = ["LiveRun", "assert_same_training", "reference_scores", "tiny_model"]
