"""Token-level training data: ``completion_datum`` builds Tinker's datum shape, and ``check_data`` refuses what
would train on the wrong thing, naming the datum and the field."""

from __future__ import annotations

import pytest
import torch

from llmrl import InvalidArgument, InvalidArgumentType, completion_datum
from llmrl.engine.requests.datums import check_data


def test_completion_datum_shifts_the_sequence_and_zeroes_the_prompts_inputs():
    datum = completion_datum([1, 2, 3], [4, 5], logprobs=[-0.5, -1.5], advantages=2.0)
    assert datum == {"model_input": [1, 2, 3, 4], "loss_fn_inputs": {
        "target_tokens": [2, 3, 4, 5], "logprobs": [0.0, 0.0, -0.5, -1.5], "advantages": [0.0, 0.0, 2.0, 2.0]}}
    with_prompt = completion_datum([1, 2, 3], [4], prompt_logprobs=torch.tensor([-2.0, -3.0]), logprobs=[-1.0])
    assert with_prompt["loss_fn_inputs"]["logprobs"] == [-2.0, -3.0, -1.0]
    (seq,) = check_data([datum], ("logprobs", "advantages"), vocab_size=10)
    assert seq.tokens == [1, 2, 3, 4, 5] and seq.num_targets == 4
    with pytest.raises(InvalidArgument, match="logprobs has 1 values for a completion of 2 tokens"):
        completion_datum([1], [4, 5], logprobs=[-1.0])
    with pytest.raises(InvalidArgument, match="non-empty completion"):
        completion_datum([1], [])


def test_check_data_names_the_datum_and_field_at_fault():
    good = completion_datum([1, 2], [3, 4], weights=1.0)
    cases = [
        ([{"model_input": [1, 2]}], InvalidArgumentType, r"data\[0\] must be a dict with 'model_input'"),
        ([good, {**good, "loss_fn_inputs": {**good["loss_fn_inputs"], "weights": [1.0]}}], InvalidArgument,
         r"data\[1\]\['loss_fn_inputs'\]\['weights'\] has 1 values for 3 target tokens"),
        ([{**good, "loss_fn_inputs": {**good["loss_fn_inputs"], "target_tokens": [2, 9, 4]}}], InvalidArgument,
         r"target_tokens'\]\[1\] is 9 but the next input token is 3"),
        ([{**good, "loss_fn_inputs": {**good["loss_fn_inputs"], "advantages": [1.0, 1.0, 1.0]}}], InvalidArgument,
         "holds 'advantages', which this loss does not read"),
        ([completion_datum([1, 2], [3, 99], weights=1.0)], InvalidArgument, "token id 99, beyond the vocabulary"),
        ([{**good, "loss_fn_inputs": {**good["loss_fn_inputs"], "weights": [0.0, 1.0, float("inf")]}}],
         InvalidArgument, r"\['weights'\]\[2\] is inf"),
        ([completion_datum([1] * 20, [3], weights=1.0)], InvalidArgument, "has 20 input tokens; this model accepts"),
        ([], InvalidArgument, "data is empty"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            check_data(data, ("weights",), vocab_size=50, max_length=16)
    with pytest.raises(InvalidArgument, match="lacks 'weights'"):
        check_data([completion_datum([1, 2], [3])], ("weights",), vocab_size=50)
    # without a loss on the servers, other inputs are neither read nor checked
    assert check_data([completion_datum([1, 2], [3], mask=[1.0], ref=[-1.0])], None, 50)[0].inputs == {}


def test_a_target_that_is_not_the_next_input_is_accepted_only_where_the_loss_reads_nothing():
    """The cookbook's rl_loop puts target 0 at the prompt's positions, with advantage and log-prob 0 there."""
    from llmrl.plugins.rl_math import UNREAD_WHEN_ZERO

    prompt, sampled = [11, 12, 13], [14, 15, 16]
    ob = len(prompt) - 1
    rl_loop = {"model_input": prompt + sampled[:-1], "loss_fn_inputs": {
        "target_tokens": [0] * ob + sampled, "logprobs": [0.0] * ob + [-1.0, -2.0, -0.5],
        "advantages": [0.0] * ob + [0.7] * 3}}
    (seq,) = check_data([rl_loop], ("logprobs", "advantages"), 50,
                        unread_when_zero=UNREAD_WHEN_ZERO["importance_sampling"])
    assert seq.tokens == prompt + sampled and seq.unscored == (0, 1)
    shifted = completion_datum(prompt, sampled, logprobs=[-1.0, -2.0, -0.5], advantages=0.7)
    assert check_data([shifted], ("logprobs", "advantages"), 50)[0] == \
        type(seq)(seq.tokens, seq.inputs)  # the same sequence and inputs, every position scored
    read = {**rl_loop, "loss_fn_inputs": {**rl_loop["loss_fn_inputs"], "advantages": [0.3] * 5}}
    with pytest.raises(InvalidArgument, match=r"target_tokens'\]\[0\] is 0 but the next input token is 12.*"
                                              r"or give advantages 0 there"):
        check_data([read], ("logprobs", "advantages"), 50, unread_when_zero=("advantages",))
    assert "dro" not in UNREAD_WHEN_ZERO  # its penalty reads every position
    for needed, unread in ((("logprobs", "advantages"), ()), (None, ())):  # dro; forward without a loss
        with pytest.raises(InvalidArgument, match="targets must be the input shifted by one"):
            check_data([rl_loop], needed, 50, unread_when_zero=unread)
