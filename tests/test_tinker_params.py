"""Tinker request fields the service refuses or reads before any call (``engine/tinker/params``): the optimizer (a
training client steps AdamW, Tinker's, so a config stepping Adam with coupled weight decay is refused rather than
trained differently) and the per-token inputs each loss reads."""

from __future__ import annotations

import pytest

from llmrl.engine.tinker.params import check_optimizer, loss_inputs, step_metrics


def test_a_training_client_is_refused_unless_the_config_steps_adamw():
    check_optimizer({}, "adamw")
    check_optimizer({"optimizer_config": {"type": "adamw"}}, "adamw")
    with pytest.raises(ValueError, match="trains with 'adam' .* set training.optimizer.type: adamw"):
        check_optimizer({}, "adam")
    with pytest.raises(ValueError, match="optimizer 'sgd' is not supported"):
        check_optimizer({"optimizer_config": {"type": "sgd"}}, "adamw")


def test_each_loss_gets_the_inputs_it_reads():
    """Clip losses read a datum's own thresholds; cross_entropy without weights weighs every token 1."""
    given = {"target_tokens": [5, 6, 7], "logprobs": [-1.0] * 3, "advantages": [0.5] * 3, "mask": [1.0] * 3,
             "clip_low_threshold": [0.9] * 3, "clip_high_threshold": [1.1] * 3}
    assert set(loss_inputs("ppo", given)) == {"target_tokens", "logprobs", "advantages", "clip_low_threshold",
                                              "clip_high_threshold"}
    assert set(loss_inputs("importance_sampling", given)) == {"target_tokens", "logprobs", "advantages"}
    assert loss_inputs("cross_entropy", given) == {"target_tokens": [5, 6, 7], "weights": [1.0, 1.0, 1.0]}
    assert loss_inputs("cross_entropy", {"target_tokens": [5], "weights": [0.5]})["weights"] == [0.5]


def test_an_existing_ready_file_is_refused_before_anything_starts(tmp_path, capsys):
    """`llmrl tinker --ready-file F` replaced a file F of the user's; it now stops first (exit 2), naming it."""
    from llmrl.engine.tinker import serve

    mine = tmp_path / "notes.txt"
    mine.write_text("the user's own")
    assert serve.main(["--ready-file", str(mine), "--api-key", "tml-x"]) == 2
    assert mine.read_text() == "the user's own"
    assert f"--ready-file {mine} exists; it is not overwritten" in capsys.readouterr().err


def test_optim_step_metrics_say_a_skipped_float16_step_and_its_halved_scale():
    assert step_metrics({"optimizer_steps": 1, "adapters": ["t"], "grad_norm": 2.5}) == {"grad_norm:mean": 2.5}
    assert step_metrics({"optimizer_steps": 0, "adapters": [], "grad_norm": None}) == {}
    skipped = {"optimizer_steps": 0, "adapters": [], "grad_norm": None, "skipped": ["t"], "loss_scale": 32768.0}
    assert step_metrics(skipped) == {"skipped:sum": 1.0, "loss_scale:mean": 32768.0}
