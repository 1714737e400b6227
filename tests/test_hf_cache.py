"""The cache argument across transformers versions (``engine/model/hf_cache.py``): a call continued from the
cache handed under the installed version's name and read back from its output gives the logits of one call over
the whole sequence (plain Hugging Face, no cache), and a decoder layer's cache is found under either name."""

from __future__ import annotations

import inspect

import torch

from llmrl.engine.model.hf_cache import cache_kwarg, cache_of, layer_cache, with_cache


def test_cache_kwarg_is_the_name_the_model_declares(reference_models):
    model, _ = reference_models["llama"]
    assert cache_kwarg() in inspect.signature(type(model).forward).parameters


def test_a_call_continued_from_the_cache_equals_one_whole_call(reference_models):
    model, _ = reference_models["llama"]
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 27]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :5], use_cache=True)
        cache = cache_of(first)
        assert cache is not None and cache.get_seq_length() == 5
        rest = model(input_ids=ids[:, 5:], position_ids=torch.arange(5, 8)[None], use_cache=True, **with_cache(cache))
    assert cache_of(rest).get_seq_length() == 8
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1), whole, rtol=1e-5, atol=1e-5)


def test_layer_cache_finds_either_name():
    cache = object()
    assert layer_cache({"cache": cache}) is cache
    assert layer_cache({"past_key_values": cache}) is cache
    assert layer_cache({"hidden_states": None}) is None
