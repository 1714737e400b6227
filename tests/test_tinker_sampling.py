"""Tinker's sampling parameters as llmrl's ``generate`` reads them (``engine/tinker/params.generate_kwargs``), run
in process through llmrl's generation on the tiny random Llama, greedy, against its own unstopped output: a list
of token ids stops at any of them (Tinker's meaning), and ``stop=[]`` stops nowhere, not even at EOS."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.tinker.params import generate_kwargs

PROMPT = [[3, 4, 5, 6]]


@pytest.fixture(scope="module")
def tiny_llama():
    from llmrl.engine.model.store.tiny_models import build_tiny

    torch.manual_seed(0)
    model, tok = build_tiny("llama")
    return model.eval(), tok


def sample(tiny_llama, **params) -> dict:
    model, tok = tiny_llama
    kwargs = generate_kwargs({"temperature": 0.0, "max_tokens": 12, **params}, 1, False)
    return generate(model, tok, "causal", plan_generate(model, tok, "causal", PROMPT, kwargs, 4096, 64, None),
                    "cpu")[0][0]


def test_a_list_of_stop_ids_stops_at_any_of_them(tiny_llama):
    free = sample(tiny_llama)["tokens"].tolist()
    assert len(free) == 12
    first, absent = free[3], next(t for t in range(10, 1000) if t not in free)
    for stop in ([first], [absent, first], [first, absent]):
        stopped = sample(tiny_llama, stop=stop)
        assert stopped["tokens"].tolist() == free[:free.index(first) + 1] and stopped["stop_reason"] == "stop"
    assert generate_kwargs({"stop": [7, 9], "max_tokens": 4}, 1, False)["stop"] == [[7], [9]]
    assert generate_kwargs({"stop": ["\n", "###"], "max_tokens": 4}, 1, False)["stop"] == ["\n", "###"]


def test_unset_max_tokens_runs_to_the_maximum_length_and_greedy_asks_for_one_sequence():
    assert generate_kwargs({"temperature": 1.0}, 4, False, room=500)["max_new_tokens"] == 500
    with pytest.raises(ValueError, match="max_tokens is unset and this model declares no maximum length"):
        generate_kwargs({}, 1, False)
    assert generate_kwargs({"temperature": 0.0, "max_tokens": 3}, 4, False)["num_return_sequences"] == 1
    assert generate_kwargs({"temperature": 0.5, "max_tokens": 3}, 4, False)["num_return_sequences"] == 4


def test_an_empty_stop_list_runs_past_eos_to_max_tokens(tiny_llama):
    model, _ = tiny_llama
    free = sample(tiny_llama)["tokens"].tolist()
    before = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = free[2]  # the third greedy token is now the model's EOS
    try:
        assert sample(tiny_llama)["tokens"].tolist() == free[:3]
        unstopped = sample(tiny_llama, stop=[])
    finally:
        model.generation_config.eos_token_id = before
    assert unstopped["tokens"].tolist() == free and unstopped["stop_reason"] == "length"
