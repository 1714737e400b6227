"""The cache argument across transformers versions (``engine/model/reuse/hf_kv.py``, ``reuse.trunk.make_caller``): the
scoring code hands its key/value cache to the model call as ``cache``, and the call passes it under the name the
model's own ``forward`` takes (``cache`` from transformers 5.24, ``past_key_values`` before it and in remote code
written for older versions). Reference: one plain Hugging Face call over the whole sequence, no cache."""

from __future__ import annotations

import inspect

import pytest
import torch

from llmrl.engine.model.reuse.hf_kv import cache_kwarg, cache_of, layer_cache
from llmrl.engine.model.reuse.trunk import make_caller
from llmrl.engine.model.scoring.planning import Needs

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 27]])


class OldStyleModel(torch.nn.Module):
    """A model shipped as remote code written before 5.24: it takes ``past_key_values`` and drops anything else
    into ``**kwargs`` unseen."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return self.inner(input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values,
                          use_cache=use_cache)


def continued_logits(model) -> torch.Tensor:
    """Logits of IDS from two calls through ``make_caller``, the second continuing from the first's cache."""
    call = make_caller(model, Needs(), None, False, lambda: [])
    with torch.no_grad():
        first = call(None, input_ids=IDS[:, :5], use_cache=True)
        cache = cache_of(first)
        assert cache is not None and cache.get_seq_length() == 5
        rest = call(None, input_ids=IDS[:, 5:], position_ids=torch.arange(5, 8)[None], use_cache=True, cache=cache)
    assert cache_of(rest).get_seq_length() == 8
    return torch.cat([first.logits, rest.logits], dim=1)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_call_continued_from_the_cache_equals_one_whole_call(reference_models, kind):
    model, _ = reference_models[kind]
    assert cache_kwarg(model) in inspect.signature(type(model).forward).parameters
    with torch.no_grad():
        whole = model(input_ids=IDS).logits
    torch.testing.assert_close(continued_logits(model), whole, rtol=1e-5, atol=1e-5)


def test_a_model_that_takes_the_old_name_gets_its_cache(reference_models):
    model, _ = reference_models["llama"]
    old = OldStyleModel(model)
    assert cache_kwarg(old) == "past_key_values"
    with torch.no_grad():
        whole = model(input_ids=IDS).logits
    torch.testing.assert_close(continued_logits(old), whole, rtol=1e-5, atol=1e-5)


def test_a_peft_wrapper_is_looked_through(reference_models):
    """PEFT's forward takes ``**kwargs``: the name is the wrapped model's (LoRA B starts at zero: same logits)."""
    import copy

    from peft import LoraConfig, get_peft_model

    model, _ = reference_models["llama"]
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_kwarg(peft) in inspect.signature(type(model).forward).parameters
    with torch.no_grad():
        whole = model(input_ids=IDS).logits
    torch.testing.assert_close(continued_logits(peft), whole, rtol=1e-5, atol=1e-5)


def test_layer_cache_finds_either_name():
    cache = object()
    assert layer_cache({"cache": cache}) is cache
    assert layer_cache({"past_key_values": cache}) is cache
    assert layer_cache({"hidden_states": None}) is None
