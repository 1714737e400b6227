"""An updater runs with torch.distributions' argument checks on, whatever turned them off for the process: importing
PEFT, or compiling a step, runs torch._dynamo's one-time patch, which turns them off process-wide, so without
``guards.distribution_checks`` a ``Categorical`` over a row of NaN would raise on a rank with no adapter and silently
sample garbage on a LoRA rank."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.training.guards import distribution_checks

Distribution = torch.distributions.Distribution


def test_an_updater_runs_with_distribution_checks_on_and_the_process_setting_is_restored():
    before = Distribution._validate_args
    try:
        Distribution.set_default_validate_args(False)  # what torch._dynamo's patch leaves behind
        bad = torch.tensor([[float("nan"), 0.0, 1.0]])
        torch.distributions.Categorical(logits=bad)  # unchecked: no error
        with distribution_checks():
            with pytest.raises(ValueError, match="logits"):
                torch.distributions.Categorical(logits=bad)
        assert Distribution._validate_args is False  # the process's own setting, back after the update
    finally:
        Distribution.set_default_validate_args(before)
