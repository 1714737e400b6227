"""Decoding with weights packed for a CPU kernel (``generation.pack_weights``: MKL's packs per row count, oneDNN's one
reordered weight): the same tokens and log-probs as without packing, and packs that follow every change of the weights
they were made from. Each test runs with each kernel this torch build has."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model import cpu_matmul
from llmrl.engine.model.decoding import loop
from llmrl.engine.model.decoding.packed_linears import KERNELS, available, default_kernel
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate


@pytest.fixture(params=[pytest.param(k, marks=pytest.mark.skipif(not available(k), reason=f"no {k} in this torch"))
                        for k in KERNELS])
def kernel(request) -> str:
    return request.param

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café"]
SAMPLED = {"max_new_tokens": 8, "do_sample": True, "num_return_sequences": 2, "top_k": 0}


@pytest.fixture()
def lora_llama(reference_models):
    """A fresh copy (the tests change its weights) of the tiny Llama with a LoRA adapter whose B is not zero."""
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model), tok


def decoder(pack, **settings) -> Decoder:
    return Decoder(GenerationSettings(pack_weights=pack, **settings), "cpu")


def run(model, tok, decoding: Decoder, kwargs=None, seed=3, prompts=PROMPTS):
    plan = plan_generate(model, tok, "causal", prompts, kwargs or SAMPLED, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=seed, decoder=decoding)


GAPS: list[float] = []  # the largest log-prob differences seen (printed by -s: MKL's packed kernel rounds its own way)


def assert_same(a, b) -> None:
    """The same tokens; log-probs within float32 rounding (1e-5, the loop's tolerance against ``score``)."""
    for row_a, row_b in zip(a, b, strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert x["tokens"].tolist() == y["tokens"].tolist()
            for key in ("logprobs", "sampling_logprobs"):
                torch.testing.assert_close(x[key], y[key], atol=1e-5, rtol=0)
                GAPS.append(float((x[key] - y[key]).abs().max()))


def no_forward_left(model) -> bool:
    return not any("forward" in vars(module) for module in model.modules())


def base(model, index: int, name: str) -> torch.nn.Linear:
    """Layer ``index``'s linear ``name`` (its base layer where LoRA wraps it)."""
    layer = model.base_model.model.model.layers[index]
    module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


@pytest.mark.parametrize("settings", [{}, {"merge_adapter": True}, {"sampler": "inverse_cdf"},
                                      {"merge_adapter": True, "static_cache": True, "length_bucket": 16}],
                         ids=["unmerged", "merged", "inverse_cdf", "static"])
@pytest.mark.parametrize("kwargs", [SAMPLED, {"max_new_tokens": 8, "do_sample": False}], ids=["sampled", "greedy"])
def test_packed_decoding_gives_the_same_tokens_and_logprobs_as_unpacked(kernel, lora_llama, settings, kwargs):
    model, tok = lora_llama
    packed = decoder(kernel, **settings)
    ours, reference = run(model, tok, packed, kwargs), run(model, tok, decoder(False, **settings), kwargs)
    assert_same(ours, reference)
    stats = packed.stats()
    assert stats["weights_packed"] > 0 and stats["packed_weights_mb"] > 0, stats
    assert no_forward_left(model)
    assert_same(run(model, tok, packed, kwargs), reference)  # the kept packs give the same again
    print(f"largest log-prob gap, packed vs unpacked: {max(GAPS):.2e}")
    assert packed.stats()["weights_packed"] == stats["weights_packed"], "nothing changed: nothing packed again"


def test_a_frozen_weight_written_in_place_is_packed_again(kernel, lora_llama):
    model, tok = lora_llama
    packed = decoder(kernel)
    run(model, tok, packed)
    count = packed.stats()["weights_packed"]
    with torch.no_grad():  # what load_state_dict does: an in-place copy through the parameter
        base(model, 1, "up_proj").weight.mul_(1.5)
    assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
    assert packed.stats()["weights_packed"] == count + 1  # that layer alone


def test_a_weight_swapped_through_data_is_packed_again(kernel, lora_llama):
    model, tok = lora_llama
    packed = decoder(kernel)
    run(model, tok, packed)
    count = packed.stats()["weights_packed"]
    weight = base(model, 0, "o_proj").weight
    original = weight.data
    weight.data = original * 0.5  # what snapshots and twins do: another tensor behind the same parameter
    try:
        assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
        assert packed.stats()["weights_packed"] == count + 1
    finally:
        weight.data = original
    assert_same(run(model, tok, packed), run(model, tok, decoder(False)))  # back: the original weight's values


def test_an_adapter_update_packs_the_merged_layers_again(kernel, lora_llama):
    model, tok = lora_llama
    packed = decoder(kernel, merge_adapter=True)
    run(model, tok, packed)
    count = packed.stats()["weights_packed"]
    with torch.no_grad():  # an optimizer step on the adapter: the merged buffers are rebuilt in place
        base_layer = model.base_model.model.model.layers[0].self_attn.q_proj
        base_layer.lora_B["default"].weight.mul_(3.0)
    assert_same(run(model, tok, packed), run(model, tok, decoder(False, merge_adapter=True)))
    merged_layers = 3 * len(model.base_model.model.model.layers)  # q_proj, v_proj, down_proj in every layer
    assert packed.stats()["merges"] == 2
    assert packed.stats()["weights_packed"] == count + merged_layers  # the merged layers alone


def test_trainable_weights_are_not_packed(kernel, reference_models):
    model, tok = reference_models["llama"]
    model = copy.deepcopy(model).eval()
    assert all(p.requires_grad for p in model.parameters())
    packed = decoder(kernel)
    assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
    assert packed.stats()["weights_packed"] == 0
    model.lm_head.weight.requires_grad_(False)  # tied to the embedding: the one frozen weight
    run(model, tok, packed)
    assert packed.stats()["weights_packed"] == 1


def test_two_row_counts_keep_their_packs_and_a_third_drops_the_oldest(lora_llama):
    model, tok = lora_llama
    packed = decoder("mkl")
    counts, held = [], []
    for samples in (2, 3, 2, 3, 1, 2):
        run(model, tok, packed, {**SAMPLED, "num_return_sequences": samples})
        counts.append(packed.stats()["weights_packed"])
        held.append(packed.stats()["packed_weights_mb"])
    per_rows = counts[0]
    assert counts == [per_rows, 2 * per_rows, 2 * per_rows, 2 * per_rows, 3 * per_rows, 4 * per_rows], counts
    assert held[1:] == [2 * held[0]] * 5, held  # the packs of the last two row counts are kept, no more


@pytest.fixture
def onednn_rows(monkeypatch) -> list[int]:
    """The rows of each product through oneDNN's linear op (prefill: the prompts' tokens; steps: one per row)."""
    rows_seen = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        default = real.default

        def __call__(self, x, *args):
            rows_seen.append(x.numel() // x.shape[-1])
            return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    return rows_seen


@pytest.mark.skipif(not available("onednn"), reason="this torch build has no oneDNN")
def test_onednn_packs_once_for_every_row_count_and_the_prefill_multiplies_with_it(lora_llama, onednn_rows):
    model, tok = lora_llama
    packed = decoder("onednn")
    rows_seen = onednn_rows
    for samples in (2, 3, 1):
        assert_same(run(model, tok, packed, {**SAMPLED, "num_return_sequences": samples}),
                    run(model, tok, decoder(False), {**SAMPLED, "num_return_sequences": samples}))
    frozen = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad)
    assert packed.stats()["weights_packed"] == frozen  # one pack each, whatever the row count
    assert packed.stats()["packed_for"] == "onednn"
    assert max(rows_seen) > 2 * len(PROMPTS)  # a prefill's product: every prompt token at once


@pytest.mark.skipif(not available("onednn"), reason="this torch build has no oneDNN")
def test_onednn_products_of_any_row_count_meet_a_bounded_set_of_row_counts(lora_llama, onednn_rows):
    """oneDNN keeps code for every shape it multiplies (see ``cpu_matmul.on_bounded_rows``): a decode step's rows
    (one per sequence still decoding: 17 to 21 here, fewer as sequences end) are padded to one of a bounded set of
    counts, and the decoded tokens and log-probs stay the unpacked decoder's."""
    model, tok = lora_llama
    packed = decoder("onednn")
    rows_seen = onednn_rows
    for samples in (17, 19, 21):
        settings = {**SAMPLED, "num_return_sequences": samples}
        assert_same(run(model, tok, packed, settings, prompts=PROMPTS[1:2]),
                    run(model, tok, decoder(False), settings, prompts=PROMPTS[1:2]))
    assert max(rows_seen) > 16  # products of more than 16 rows were multiplied
    assert all(cpu_matmul.padded_rows(n) == n for n in rows_seen), sorted(set(rows_seen))


def test_auto_packs_for_onednn_on_amd_cpus_and_mkl_on_others(monkeypatch):
    for vendor, expected in (("AuthenticAMD", "onednn"), ("GenuineIntel", "mkl")):
        monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda vendor=vendor: vendor)
        if available(expected):
            assert default_kernel() == expected
            assert Decoder(GenerationSettings(), "cpu").stats()["packed_for"] == expected
    assert Decoder(GenerationSettings(pack_weights="mkl"), "cpu").stats()["packed_for"] == "mkl"
    assert Decoder(GenerationSettings(), "cuda").stats()["packed_for"] is None
    monkeypatch.undo()
    print("this machine's CPU:", cpu_matmul.cpu_vendor() or "unknown")


def test_auto_packs_for_the_kernel_cpu_matmul_names(monkeypatch):
    """A server whose cpu_matmul is torch decodes with MKL's packs on any CPU, one whose cpu_matmul is onednn with
    oneDNN's; an explicit pack_weights kernel wins over both."""
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda vendor=vendor: vendor)
        for setting, expected in (("torch", "mkl"), ("onednn", "onednn")):
            monkeypatch.setattr(cpu_matmul, "_choice", [setting])
            if available(expected):
                assert default_kernel() == expected, (vendor, setting)
                assert Decoder(GenerationSettings(), "cpu").stats()["packed_for"] == expected
        if available("mkl"):
            assert Decoder(GenerationSettings(pack_weights="mkl"), "cpu").stats()["packed_for"] == "mkl"


def test_an_error_while_decoding_puts_every_layer_back(kernel, lora_llama, monkeypatch):
    model, tok = lora_llama
    packed = decoder(kernel)
    reference = run(model, tok, decoder(False))
    calls = []

    def failing(probs, sampler):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a failure mid-decode (simulated)")
        return torch.multinomial(probs, 1).squeeze(1)

    monkeypatch.setattr(loop, "draw", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        run(model, tok, packed)
    assert no_forward_left(model)
    monkeypatch.undo()
    assert_same(run(model, tok, packed), reference)


def test_a_weight_made_trainable_loses_its_packs(kernel, lora_llama):
    """A weight trained for a while (written through ``.data``, as DeepSpeed writes, no version bump) and frozen
    again is packed again: its packs were dropped when it stopped being packed."""
    model, tok = lora_llama
    packed = decoder(kernel)
    run(model, tok, packed)
    weight = base(model, 1, "gate_proj").weight
    weight.requires_grad_(True)
    try:
        assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
        weight.data.mul_(1.5)  # invisible to the parameter's version counter
    finally:
        weight.requires_grad_(False)
    assert_same(run(model, tok, packed), run(model, tok, decoder(False)))


def test_another_parameter_over_the_same_memory_is_packed_again(kernel, lora_llama):
    model, tok = lora_llama
    packed = decoder(kernel)
    run(model, tok, packed)
    count = packed.stats()["weights_packed"]
    layer = base(model, 0, "up_proj")
    layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)  # a counter of its own
    run(model, tok, packed)
    assert packed.stats()["weights_packed"] == count + 1


def test_linear_subclasses_with_a_forward_of_their_own_are_not_packed(kernel, lora_llama):
    model, tok = lora_llama

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer = model.base_model.model.model.layers[1].mlp
    old = layer.up_proj
    layer.up_proj = Scaled(old.in_features, old.out_features, bias=False)
    layer.up_proj.weight = torch.nn.Parameter(old.weight.detach().clone(), requires_grad=False)
    assert_same(run(model, tok, decoder(kernel)), run(model, tok, decoder(False)))


def test_an_adapter_over_a_trainable_base_weight_decodes_unmerged(kernel, lora_llama):
    """The merged copy is rebuilt when the adapter changes; a trained base weight under it would go unseen."""
    model, tok = lora_llama
    base(model, 0, "q_proj").weight.requires_grad_(True)
    merging = decoder(kernel, merge_adapter=True)
    assert_same(run(model, tok, merging), run(model, tok, decoder(False)))
    assert merging.stats()["merges"] == 0


def test_under_zero3_only_the_packs_of_weights_that_are_their_own_shard_outlive_the_call(kernel, lora_llama):
    """Under ZeRO-3 a generate call's weights are gathered for it. In a group of one rank each gathered weight is its
    own shard, which stays allocated: its pack is kept for the next call. In a group of several ranks the gathered
    weight is freed after the call: its pack, which would hold that memory, is dropped at the call's end."""
    model, tok = lora_llama
    own_shard, half_shard = base(model, 0, "up_proj").weight, base(model, 1, "up_proj").weight
    own_shard.ds_tensor = own_shard.data.view(-1)  # as DeepSpeed's gather leaves a one-rank group's weight
    half_shard.ds_tensor = torch.zeros(half_shard.numel() // 2)  # two ranks: this rank holds half
    try:
        packed = Decoder(GenerationSettings(pack_weights=kernel), "cpu", zero3=True)
        assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
        kept = {pack.holder.data_ptr() for pack in packed.packed._kept.values()}
        assert own_shard.data_ptr() in kept and half_shard.data_ptr() not in kept
        assert packed.stats()["packed_weights_mb"] == own_shard.numel() * 4 / 2**20
        count = packed.stats()["weights_packed"]
        assert_same(run(model, tok, packed), run(model, tok, decoder(False)))
        assert packed.stats()["weights_packed"] == count + (count - 1), "all but the own shard's packed again"
    finally:
        del own_shard.ds_tensor, half_shard.ds_tensor
