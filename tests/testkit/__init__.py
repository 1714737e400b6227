"""The test kit: what tests (and the benchmark) share. Not installed with llmrl."""

from testkit.live import LiveRun
from testkit.models import reference_scores, tiny_model

__all__ = ["LiveRun", "reference_scores", "tiny_model"]
