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
def gathered(model, held: list):
    """Every parameter at a fresh address for the block (as ZeRO-3's gather leaves them), then back. The copies are
    appended to ``held``, so that a later call's copies cannot take their addresses."""
    before = [(p, p.data) for p in model.parameters()]
    for p, data in before:
        p.data = data.clone()
        held.append(p.data)
    try:
        yield
    finally:
        for p, data in before:
            p.data = data


@pytest.fixture(scope="module")
def lora_llama(reference_models):
    """The tiny Llama with a LoRA adapter whose B is not zero."""
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model), tok


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
    assert layer.weight.data_ptr() == weight.data_ptr() and len(kept._buffers) == 2  # kept until released
    kept.release()
    assert kept.held_bytes() == 0


def test_a_weight_that_is_its_own_zero3_shard_is_not_copied():
    """In a ZeRO-3 group of one rank, DeepSpeed's gather hands each parameter its own shard (which does not move):
    nothing to copy. A parameter holding half of its values in its shard (two ranks) is copied."""
    whole, half = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    whole.ds_tensor = whole.data.view(-1)  # as DeepSpeed's NoGatherHandle leaves it: the shard, viewed whole
    half.ds_tensor = torch.randn(6)
    kept = KeptWeights()
    at = whole.data_ptr(), half.data_ptr()
    with kept.swapped_in([whole, half]):
        assert whole.data_ptr() == at[0] and half.data_ptr() != at[1]
    assert kept.allocations == 1 and kept.copies == 1 and (whole.data_ptr(), half.data_ptr()) == at


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


def decode_twice(model, tok, settings: dict, kwargs: dict, zero3: bool = True, between=None, max_rows: int = 64):
    """Two generate calls, each on freshly gathered weights; ``between(model)`` runs between them (a training step
    would). Returns both calls' results and the decoder."""
    decoder = Decoder(GenerationSettings(**settings), "cpu", zero3=zero3)
    results, held = [], []
    for call in range(2):
        if call and between is not None:
            between(model)
        plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, max_rows, 512)
        with gathered(model, held):
            results.append(generate(model, tok, "causal", plan, "cpu", decoder=decoder, whole_weights=True))
    return results, decoder


def trained_a_step(model) -> None:
    """Moves a weight the decode step reads from its kept copy (a norm) and one merged into the adapter's buffers."""
    with torch.no_grad():
        inner = model.get_base_model().model
        inner.norm.weight.mul_(1.5)
        inner.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(0.3)


@pytest.mark.slow
def test_zero3_decodes_from_kept_weights_with_a_compiled_step_that_never_sees_them_move(lora_llama):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on the CPU needs a C compiler")
    from testkit.decoding import plain_logprobs, same_samples

    model, tok = lora_llama
    model = copy.deepcopy(model)  # trained between the calls below
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    (first, again), decoder = decode_twice(model, tok, {"compile": True, "merge_adapter": True, "length_bucket": 16},
                                           kwargs, between=trained_a_step, max_rows=2)
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    reference = generate(model, tok, "causal", plan, "cpu")  # Hugging Face's generate, on the trained weights
    assert same_samples(again, reference) and not same_samples(first, reference)
    stats = decoder.stats()
    assert stats["calls"] == {"llmrl": 2} and stats["compiled_shapes"] == [(8, 16, 16), (8, 32, 32)]  # 2 batches a call
    assert stats["weight_moves"] == 0, "the compiled step read weights at other addresses in a later batch"
    assert stats["kept_weights_mb"] > 0 and stats["merged_weights_mb"] > 0 and stats["static_cache_mb"] > 0
    assert stats["merges"] == 2  # once per call (the base weights are gathered anew), in place
    from llmrl.engine.model.decoding.merged_lora import lora_layers

    inner = model.get_base_model()
    read = weights_read(inner, [layer for layer in lora_layers(inner) if "default" in layer.lora_A])
    assert decoder.kept.copies == 2 * len(read)  # each call's weights copied once, not once per batch
    for prompt, (sample,) in zip(PROMPTS, again):
        torch.testing.assert_close(sample["logprobs"], plain_logprobs(model, tok, prompt, sample["tokens"].tolist()),
                                   atol=3e-5, rtol=0)


def test_without_kept_weights_zero3_decodes_without_a_static_cache_and_moving_weights_are_counted(lora_llama):
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 4, "do_sample": False}
    _, plain = decode_twice(model, tok, {"compile": True, "merge_adapter": True, "keep_gathered": False}, kwargs)
    assert not plain.compiled and plain.static is None and plain.kept is None
    assert plain.stats()["merged_weights_mb"] == 0.0  # built on the call's gathered weights, freed after it
    _, idle = decode_twice(model, tok, {"keep_gathered": True}, kwargs)  # no static cache: nothing reads addresses
    assert idle.kept is None and idle.static is None
    # a static cache on weights that move (not ZeRO-3 here, so nothing keeps them): the later call is counted
    _, moving = decode_twice(model, tok, {"static_cache": True, "merge_adapter": True, "length_bucket": 16}, kwargs,
                             zero3=False)
    assert moving.stats()["weight_moves"] == 1
    _, kept = decode_twice(model, tok, {"static_cache": True, "merge_adapter": True, "length_bucket": 16,
                                        "keep_gathered": True}, kwargs)
    assert kept.stats()["weight_moves"] == 0 and kept.stats()["kept_weights_mb"] > 0


def test_an_error_mid_decode_puts_every_gathered_weight_back(lora_llama, monkeypatch):
    from llmrl.engine.model.decoding import loop

    model, tok = lora_llama
    decoder = Decoder(GenerationSettings(static_cache=True, merge_adapter=True, keep_gathered=True), "cpu", zero3=True)
    held: list = []
    seen = {}

    def failing(inner, *args, **kwargs):
        seen.update({name: p.data_ptr() for name, p in inner.named_parameters()})
        raise RuntimeError("failed mid-decode")

    monkeypatch.setattr(loop, "decode", failing)
    plan = plan_generate(model, tok, "causal", PROMPTS, {"max_new_tokens": 4}, 8192, 64, 512)
    inner = model.get_base_model()
    with gathered(model, held):
        gathered_at = {name: p.data_ptr() for name, p in inner.named_parameters()}
        with pytest.raises(RuntimeError, match="failed mid-decode"):
            generate(model, tok, "causal", plan, "cpu", decoder=decoder, whole_weights=True)
        assert {name: p.data_ptr() for name, p in inner.named_parameters()} == gathered_at
    moved = [name for name, ptr in seen.items() if ptr != gathered_at[name]]
    assert moved and all("lora_" not in name for name in moved)  # inside: kept and merged buffers
    assert any(name.endswith("q_proj.base_layer.weight") for name in moved)  # a merged one
    assert any(name.endswith("norm.weight") for name in moved)  # a kept one
