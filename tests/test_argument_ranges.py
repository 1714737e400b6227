"""Numbers out of their range are refused before anything runs, naming the argument: generate's counts and sampling
numbers (a float count was cut, a NaN top_p ignored), a stop id the model never samples, a loss's clip thresholds
given as epsilons, a positive log-prob, a NaN adapter alpha, a seed past 64 bits, NaN on the command line. Numbers
of numpy's kinds are taken where Python's are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmrl.engine.errors import ConfigError, InvalidArgument
from llmrl.engine.requests.generate import check_generate_args

NAN = float("nan")


@pytest.mark.parametrize("kwargs, words", [
    ({"max_new_tokens": 2.7}, "max_new_tokens must be an int >= 1, got float 2.7"),
    ({"max_new_tokens": "3"}, "max_new_tokens must be an int >= 1, got str"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int"),
    ({"num_beams": 0}, "num_beams must be an int >= 1"),
    ({"top_k": -1}, "top_k must be an int >= 0"),
    ({"top_p": NAN}, "top_p must be a number in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be a number in (0, 1]"),
    ({"temperature": 0, "do_sample": True}, "temperature must be a number > 0 (for greedy decoding pass do_sample="),
    ({"temperature": float("inf")}, "temperature must be a number > 0"),
    ({"repetition_penalty": "high"}, "repetition_penalty must be a number > 0"),
    ({"min_new_tokens": 10, "max_new_tokens": 2}, "min_new_tokens (10) exceeds max_new_tokens (2)"),
])
def test_generate_numbers_out_of_range_are_refused_naming_them(kwargs, words):
    with pytest.raises(InvalidArgument) as info:
        check_generate_args(kwargs)
    assert words in str(info.value)


def test_generate_numbers_in_range_pass_and_none_means_the_default():
    given = {"max_new_tokens": np.int64(5), "min_new_tokens": 5, "top_k": 0, "top_p": np.float32(0.9),
             "temperature": 0.7, "do_sample": True, "stop": ["\n"], "num_beams": None}
    checked = check_generate_args(given)
    assert checked == {"max_new_tokens": 5, "min_new_tokens": 5, "top_k": 0, "top_p": np.float32(0.9),
                       "temperature": 0.7, "do_sample": True, "stop": ["\n"]}
    assert type(checked["max_new_tokens"]) is int
    assert check_generate_args({"temperature": 0}) == {"temperature": 0}  # greedy: Hugging Face ignores it


def test_a_stop_id_outside_the_vocabulary_is_refused():
    from llmrl.engine.model.generation import plan_generate

    with pytest.raises(ValueError, match=r"stop token id 400 is outside the model's vocabulary \[0, 320\)"):
        plan_generate(None, None, "causal", ["a"], {"stop": [[5, 400]]}, 8192, 64, None, vocab_size=320)


@pytest.mark.parametrize("name, config, words", [
    ("ppo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.28}, "not the epsilons themselves"),
    ("gspo", {"clip_low_threshold": 1.1, "clip_high_threshold": 1.2}, "0 <= low <= 1 <= high"),
    ("cispo", {"clip_low_threshold": -0.5}, "0 <= low <= 1 <= high"),
    ("dro", {"beta": -0.1}, r"needs loss_fn_config\[.beta.\] >= 0"),
])
def test_a_losss_thresholds_out_of_range_are_refused(name, config, words):
    """With 0.2 / 0.28 the ppo loss at ratio 1 is -0.28 A with no gradient: nothing learnt, no error."""
    from llmrl.plugins.rl_math import token_loss_settings

    with pytest.raises(ValueError, match=words):
        token_loss_settings(name, config)
    assert token_loss_settings("ppo", {"clip_low_threshold": np.float32(0.8)})["clip_high_threshold"] == 1.2
    assert token_loss_settings("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}


def test_a_positive_log_prob_given_per_token_is_refused():
    """grpo and ppo_tokens trained on sign-flipped log-probs (clip_fraction 1.0) where ppo refused them."""
    from llmrl.plugins.rollouts import token_rows_of

    lengths = torch.tensor([2, 3])
    good = [[[-0.5, -1.0], [-0.25, 0.0, -2.0]]]
    assert token_rows_of(good, [2], lengths, [0], "old_logprobs")[1].tolist() == [-0.25, 0.0, -2.0]
    with pytest.raises(ValueError, match=r"old_logprobs\[7\]\[1\]\[2\] is 2.0, above 0"):
        token_rows_of([[[-0.5, -1.0], [-0.1, -0.3, 2.0]]], [2], lengths, [7], "old_logprobs")
    assert token_rows_of([[[0.5, 1.0], [1.0, 2.0, 3.0]]], [2], lengths, [0], "rewards").max() == 3.0  # not log-probs


def test_seeds_adapter_alphas_and_step_settings_out_of_range():
    from llmrl.engine.requests.adapters import check_create_args
    from llmrl.engine.requests.inputs import check_seed
    from llmrl.engine.requests.optim_step import check_step_settings

    assert check_seed(2**62 - 1) == 2**62 - 1 and check_seed(-5) == -5
    with pytest.raises(InvalidArgument, match=r"seed must lie in \[-2\*\*62, 2\*\*62\)"):
        check_seed(2**64)  # Overflow when unpacking long long, on a server
    for alpha in (NAN, float("inf"), 0.0):
        with pytest.raises(InvalidArgument, match="alpha must be a positive number"):
            check_create_args(4, alpha, 0, None)
    assert check_create_args(4, np.float32(8), 0, None)["alpha"] == 8.0
    assert check_step_settings({"learning_rate": np.float32(1e-3)}, "adamw") == {
        "learning_rate": pytest.approx(1e-3)}
    assert check_step_settings({"learning_rate": 0}, "adamw") == {"learning_rate": 0.0}  # Tinker takes it
    with pytest.raises(InvalidArgument, match=r"adam_params\['learning_rate'\] must be >= 0"):
        check_step_settings({"learning_rate": -1e-3}, "adamw")


def test_nan_on_the_command_line_is_refused(tiny):
    from llmrl.engine.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(raw={"llms": {"main": {"model": tiny["llama"]}}},
                    overrides=["llms.main.training.optimizer.lr=.nan"])
    assert ("llms.main.training.optimizer.lr", "nan is not a finite number; give a number (or null where the field "
            "allows none)") in err.value.problems


def test_dpo_given_per_token_reference_log_probs_names_them():
    """float() of a list failed on a server with a TypeError that named neither the argument nor the pair."""
    from llmrl.plugins.dpo import DPOUpdater
    from llmrl.plugins.update_batch import UpdateBatch

    batch = UpdateBatch(contexts=["a", "b"], candidates=[[" x", " y"], [" x", " y"]], indices=[4, 5],
                        kwargs={"ref_logprobs": [[-1.0, -2.0], [[-0.5, -0.5], -2.0]]}, global_size=2, replica=0,
                        num_replicas=1, replica_sizes=[2])
    with pytest.raises(ValueError, match=r"ref_logprobs\[5\]\[0\] holds 2 values; dpo reads one number per"):
        DPOUpdater()._references(batch, None)
    batch.kwargs["ref_logprobs"] = [[-1.0, torch.tensor(-2.0)], [np.float32(-0.5), torch.tensor([-2.0])]]
    assert DPOUpdater()._references(batch, None).tolist() == [[-1.0, -2.0], [-0.5, -2.0]]  # one-element ones too
