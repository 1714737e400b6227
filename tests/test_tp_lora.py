"""LoRA over tensor-parallel layers, in one process (:mod:`llmrl.engine.model.tp_lora`): the parts each rank applies
add up to the whole adapter's output, against plain ``B(A(x))`` (a column-split layer's ranks give its output rows in
turn; a row-split layer's ranks give parts of A's output whose sum B maps, where each rank sees its columns of x),
and layers it cannot split for are refused by name. Across ranks, against plain PEFT, the live tests check it:
``test_run_time_adapters_live.py``, ``test_client_training_live.py`` and ``test_adapter_isolation_live.py``."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model import tp_lora


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo world of this process alone: the parts' sums over it are the identity, so each simulated rank's part
    is computed here and the test adds them."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()  # (the worker's later tests find none, as before)


def lora(features_in: int, features_out: int, rank: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.nn.Linear(features_in, rank, bias=False), torch.nn.Linear(rank, features_out, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.randn(a.weight.shape, generator=g))
        b.weight.copy_(torch.randn(b.weight.shape, generator=g))
    return a, b


def part(linear: torch.nn.Linear, group, **how) -> tp_lora.AdapterPart:
    """A part over ``linear``'s weight (a new linear sharing it: :meth:`~tp_lora.AdapterPart.of` changes the linear
    it is given, and each simulated rank here needs its own)."""
    twin = torch.nn.Linear(linear.in_features, linear.out_features, bias=False)
    twin.weight = linear.weight
    return tp_lora.AdapterPart.of(twin, group, **how)


@pytest.mark.parametrize("sizes", [[4, 4], [3, 5], [2, 2, 4]])
def test_column_split_parts_give_the_whole_outputs_in_turn(group, sizes):
    a, b = lora(6, sum(sizes))
    x = torch.randn(2, 5, 6)
    whole = b(a(x))
    parts, start = [], 0
    for size in sizes:
        part_a = part(a, group, sum_gradient=True)
        part_b = part(b, group, dim=0, start=start, size=size)
        parts.append(part_b(part_a(x)))
        start += size
    torch.testing.assert_close(torch.cat(parts, -1), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sizes", [[4, 4], [3, 5]])
def test_row_split_parts_sum_to_the_whole_output_and_gradients(group, sizes):
    a, b = lora(sum(sizes), 7)
    x = torch.randn(2, 5, sum(sizes))
    whole = b(a(x))
    whole.square().sum().backward()
    want_a, want_b = a.weight.grad.clone(), b.weight.grad.clone()
    a.weight.grad = b.weight.grad = None
    summed, start = 0, 0
    for size in sizes:  # each rank's part of A's output (the sum over ranks is the identity here: added by hand)
        part_a = part(a, group, dim=1, start=start, size=size, sum_output=True)
        summed = summed + part_a(x[..., start:start + size])
        start += size
    out = b(summed)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=0)
    out.square().sum().backward()
    torch.testing.assert_close(a.weight.grad, want_a, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(b.weight.grad, want_b, atol=1e-4, rtol=1e-5)


def test_a_part_is_the_adapters_own_linear_with_its_weight_and_hooks(group):
    """The part is the PEFT linear itself: the same object, weight and forward hooks (ZeRO-3 gathers a weight in
    hooks on the module that owns it), and a linear that is already a part, or has a bias, is refused."""
    a, _ = lora(4, 4)
    weight, calls = a.weight, []
    a.register_forward_pre_hook(lambda module, args: calls.append(module))
    made = tp_lora.AdapterPart.of(a, group, dim=1, start=0, size=2)
    assert made is a and isinstance(a, tp_lora.AdapterPart) and dict(a.named_parameters()) == {"weight": weight}
    assert "columns 0:2" in repr(a)
    a(torch.randn(3, 2))
    assert calls == [a]
    for wrong in (a, torch.nn.Linear(4, 4)):
        with pytest.raises(TypeError, match="torch.nn.Linear without bias"):
            tp_lora.AdapterPart.of(wrong, group)


def test_a_layer_split_in_a_way_llmrl_does_not_split_adapters_for_is_refused_by_name():
    class Fused(torch.nn.Module):
        mp_group = None

    with pytest.raises(ValueError, match=r"LoRA layer model\.layers\.0\.qkv wraps a Fused.*target_modules"):
        tp_lora._split_of(Fused(), "model.layers.0.qkv")
    assert tp_lora._split_of(torch.nn.Linear(2, 2), "lm_head") is None  # whole: the adapter applies as it is


def test_a_new_adapter_on_a_split_layer_no_configured_adapter_wraps_is_refused_by_name():
    class Split(torch.nn.Module):
        mp_group = None

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.up_proj = Split()
    model.lm_head = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"LLM 'p': mlp\.up_proj is split over the tensor-parallel ranks"):
        tp_lora.check_split_targets(model, ["up_proj", "lm_head"], "LLM 'p'")
    tp_lora.check_split_targets(model, ["lm_head"], "LLM 'p'")  # a whole layer: PEFT wraps it


def test_rows_of_several_adapters_run_in_the_calls_order_as_peft_mixes_them(group):
    """A split layer's rows of several adapters (a generate call naming one per prompt): each adapter in the call's
    order, whatever order a ``set`` of the names takes in this process, and the output PEFT's mixed forward gives."""
    from peft import LoraConfig, get_peft_model

    from llmrl.engine.model.row_adapters import RowAdapters

    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(6, 5))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False))
    for name in ("zeta", "alpha", "mid"):
        model.add_adapter(name, LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False))
    layer = model.base_model.model.proj
    names = ["mid", "zeta", "alpha", "zeta"]
    x = torch.randn(4, 3, 6)
    with torch.no_grad():
        want = layer._mixed_batch_forward(x, adapter_names=names)
        rows = RowAdapters(names)
        rows.use_batch([0, 1, 2, 3])
        seen = []
        hooks = [layer.lora_A[n].register_forward_hook(lambda m, i, o, n=n: seen.append(n)) for n in rows.adapters]
        got = tp_lora.OrderedRows(layer, rows)(x)
        for hook in hooks:
            hook.remove()
    assert seen == ["mid", "zeta", "alpha"]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_word_target_naming_a_split_layer_no_adapter_wraps_is_refused_not_skipped():
    """``targets=["attention"]`` on a model whose o_proj is split and wrapped by no LoRA layer: o_proj is named, so
    the new adapter is refused rather than made without it."""
    from llmrl.engine.model.training.new_adapters import target_modules

    class Split(torch.nn.Module):
        mp_group = None

    model = torch.nn.Module()
    model.self_attn = torch.nn.Module()
    model.self_attn.q_proj = torch.nn.Linear(2, 2)
    model.self_attn.o_proj = Split()
    names = target_modules(model, ["attention"], tensor_parallel=2)
    assert names == ["self_attn.o_proj", "self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"self_attn\.o_proj is split over the tensor-parallel ranks"):
        tp_lora.check_split_targets(model, names, "LLM 'p'")
