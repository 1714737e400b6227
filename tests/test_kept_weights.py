"""ZeRO-3's gathered weights kept between decoding calls (``generation.keep_gathered``): the buffers hold each call's
values at the same addresses, the gathered tensors come back after the call (an error included), and the decoding
loop under ZeRO-3 then runs its static cache and compiled step on weights that never move, with Hugging Face's
tokens and a plain forward's log-probs. ZeRO-3's gather is stood in for by fresh copies of every weight at every
call (new addresses, the same values), which is what a gather hands the model."""

from __future__ import annotations

import contextlib
import copy
import shutil

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.kept_weights import KeptWeights, weights_read
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]


@contextlib.contextmanager
def gathered(model):
    """Every parameter at a fresh address for the block (as ZeRO-3's gather leaves them), then back."""
    before = [(p, p.data) for p in model.parameters()]
    for p, data in before:
        p.data = data.clone()
    try:
        yield
    finally:
        for p, data in before:
            p.data = data


@pytest.fixture(scope="module")
def lora_llama(reference_models):
    """The tiny Llama with a LoRA adapter whose B is not zero."""
    from peft import LoraConfig, get_peft_model

    model, tok = reference_models["llama"]
    torch.manual_seed(0)
    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                              init_lora_weights=False)).eval()
    return adapted, tok


def test_buffers_hold_each_calls_values_at_the_same_addresses_and_the_tensors_come_back():
    layer = torch.nn.Linear(3, 2)
    kept = KeptWeights()
    seen = []
    for call in range(2):
        gathered_values = [torch.full_like(p, float(call + k)) for k, p in enumerate(layer.parameters())]
        for p, value in zip(layer.parameters(), gathered_values):
            p.data = value
        with kept.swapped_in(list(layer.parameters())):
            seen.append([p.data_ptr() for p in layer.parameters()])
            for p, value in zip(layer.parameters(), gathered_values):
                assert p.data_ptr() != value.data_ptr() and torch.equal(p.data, value)
        assert all(p.data_ptr() == value.data_ptr() for p, value in zip(layer.parameters(), gathered_values))
    assert seen[0] == seen[1] and kept.allocations == 2
    assert kept.held_bytes() == sum(p.numel() * 4 for p in layer.parameters())
    weight = layer.weight.data
    with pytest.raises(RuntimeError, match="mid-call"), kept.swapped_in([layer.weight]):
        raise RuntimeError("mid-call")
    assert layer.weight.data_ptr() == weight.data_ptr() and len(kept._buffers) == 1  # the bias's buffer was not asked for: freed
    kept.release()
    assert kept.held_bytes() == 0


def test_the_weights_read_leave_out_merged_layers_base_and_lora_weights(lora_llama):
    from llmrl.engine.model.decoding.merged_lora import lora_layers

    model, _ = lora_llama
    inner = model.get_base_model()
    layers = [layer for layer in lora_layers(inner) if "default" in layer.lora_A]
    read = {id(p) for p in weights_read(inner, layers)}
    names = {name for name, p in inner.named_parameters() if id(p) not in read}
    assert names and all("lora_" in name or any(f".{m}.base_layer.weight" in name for m in
                                                ("q_proj", "v_proj", "down_proj")) for name in names)
    assert sum("base_layer.weight" in name for name in names) == len(layers)
    assert {id(p) for p in weights_read(inner, [])} == {id(p) for p in inner.parameters()}


def decode_twice(model, tok, settings: dict, kwargs: dict, zero3: bool = True):
    decoder = Decoder(GenerationSettings(**settings), "cpu", zero3=zero3)
    results = []
    for _ in range(2):
        plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
        with gathered(model):
            results.append(generate(model, tok, "causal", plan, "cpu", decoder=decoder, whole_weights=True))
    return results, decoder


@pytest.mark.slow
def test_zero3_decodes_from_kept_weights_with_a_compiled_step_that_never_sees_them_move(lora_llama):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on the CPU needs a C compiler")
    from test_decoding import plain_logprobs, same_samples

    model, tok = lora_llama
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    reference = generate(model, tok, "causal", plan, "cpu")  # Hugging Face's generate
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    (first, again), decoder = decode_twice(model, tok, {"compile": True, "merge_adapter": True, "length_bucket": 16},
                                           kwargs)
    assert same_samples(first, reference) and same_samples(again, reference)
    stats = decoder.stats()
    assert stats["calls"] == {"llmrl": 2} and stats["compiled_shapes"] == [(8, 32)]
    assert stats["weight_moves"] == 0, "the compiled step read weights at other addresses in the second call"
    assert stats["kept_weights_mb"] > 0 and stats["merged_weights_mb"] > 0 and stats["static_cache_mb"] > 0
    assert stats["merges"] == 2  # the base weights were gathered anew: merged again, in place
    for prompt, (sample,) in zip(PROMPTS, again):
        torch.testing.assert_close(sample["logprobs"], plain_logprobs(model, tok, prompt, sample["tokens"].tolist()),
                                   atol=3e-5, rtol=0)
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())


def test_without_kept_weights_zero3_decodes_without_a_static_cache_and_moving_weights_are_counted(lora_llama):
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 4, "do_sample": False}
    _, plain = decode_twice(model, tok, {"compile": True, "merge_adapter": True, "keep_gathered": False}, kwargs)
    assert not plain.compiled and plain.static is None and plain.kept is None
    assert plain.stats()["merged_weights_mb"] == 0.0  # built on the call's gathered weights, freed after it
    # a static cache on weights that move (not ZeRO-3 here, so nothing keeps them): each later call is counted
    _, moving = decode_twice(model, tok, {"static_cache": True, "merge_adapter": True, "length_bucket": 16}, kwargs,
                             zero3=False)
    assert moving.stats()["weight_moves"] == 1
    _, kept = decode_twice(model, tok, {"static_cache": True, "merge_adapter": True, "length_bucket": 16,
                                        "keep_gathered": True}, kwargs)
    assert kept.stats()["weight_moves"] == 0 and kept.stats()["kept_weights_mb"] > 0
