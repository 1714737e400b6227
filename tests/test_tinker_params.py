"""Tinker request fields the service refuses or reads before any call (``engine/tinker/params``): the optimizer (a
training client steps AdamW, Tinker's, so a config stepping Adam with coupled weight decay is refused rather than
trained differently) and the per-token inputs each loss reads."""

from __future__ import annotations

import pytest

from llmrl.engine.tinker.params import check_optimizer, loss_inputs


def test_a_training_client_is_refused_unless_the_config_steps_adamw():
    check_optimizer({}, "adamw")
    check_optimizer({"optimizer_config": {"type": "adamw"}}, "adamw")
    with pytest.raises(ValueError, match="trains with 'adam' .* set training.optimizer.type: adamw"):
        check_optimizer({}, "adam")
    with pytest.raises(ValueError, match="optimizer 'sgd' is not supported"):
        check_optimizer({"optimizer_config": {"type": "sgd"}}, "adamw")


def test_clip_losses_read_a_datums_own_thresholds():
    assert loss_inputs("ppo") == {"target_tokens", "logprobs", "advantages", "clip_low_threshold",
                                  "clip_high_threshold"}
    assert loss_inputs("importance_sampling") == {"target_tokens", "logprobs", "advantages"}
    assert loss_inputs("cross_entropy") == {"target_tokens", "weights"}
