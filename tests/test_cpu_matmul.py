"""Frozen float32 products through oneDNN (``cpu_matmul``): the same values and input gradients as torch's own
products (float32 rounding), trainable weights left to torch, every layer's own forward back afterwards, and the
scoring and training passes of a served model routed through it."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.model import cpu_matmul
from llmrl.engine.model.decoding.packed_linears import available

pytestmark = pytest.mark.skipif(not available("onednn"), reason="this torch build has no oneDNN")


@pytest.fixture()
def onednn_calls(monkeypatch):
    """This process set to oneDNN, with each oneDNN product counted."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(x, *args):
        calls.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(cpu_matmul, "_product", lambda x, w, b: counted(x, w, b, "none", [], ""))
    monkeypatch.setattr(cpu_matmul, "_choice", ["onednn"])
    return calls


@pytest.mark.parametrize("shape", [(5, 24), (3, 7, 24), (0, 24)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_and_its_input_gradient_equal_torch(onednn_calls, shape, with_bias):
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    bias = torch.randn(40) if with_bias else None
    x = torch.randn(*shape, requires_grad=True)
    ours = cpu_matmul.linear(x, weight, bias)
    grad = torch.randn_like(ours)
    (ours * grad).sum().backward()
    ours_grad, x.grad = x.grad, None
    reference = torch.nn.functional.linear(x, weight, bias)
    (reference * grad).sum().backward()
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_grad, x.grad, atol=1e-5, rtol=1e-5)
    assert len(onednn_calls) == 2  # the forward product and the input's gradient
    with torch.no_grad():
        torch.testing.assert_close(cpu_matmul.times_weight(grad, weight), grad @ weight, atol=1e-5, rtol=1e-5)


def test_trainable_weights_other_dtypes_and_the_torch_setting_use_torch(onednn_calls):
    x = torch.randn(4, 8)
    cpu_matmul.linear(x, torch.randn(6, 8, requires_grad=True))
    cpu_matmul.linear(x.double(), torch.randn(6, 8, dtype=torch.float64))
    cpu_matmul.linear(x, torch.randn(6, 8), torch.randn(6, requires_grad=True))
    assert onednn_calls == []
    cpu_matmul.configure("torch")
    assert not cpu_matmul.onednn_active()
    cpu_matmul.linear(x, torch.randn(6, 8))
    assert onednn_calls == []
    with pytest.raises(ValueError, match="cpu_matmul 'mkl'.*auto, torch, onednn"):
        cpu_matmul.configure("mkl")


def test_auto_uses_onednn_on_amd_cpus_only(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "_choice", ["auto"])
    for vendor, expected in (("AuthenticAMD", True), ("GenuineIntel", False), ("", False)):
        monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda vendor=vendor: vendor)
        assert cpu_matmul.onednn_active() is expected


def test_a_lora_model_scores_and_trains_the_same_through_frozen_linears(reference_models, onednn_calls):
    """Log-probs and the adapter's gradients (which flow back through every frozen layer above it) equal torch's."""
    from peft import LoraConfig, get_peft_model

    model, _ = reference_models["llama"]
    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))
    ids = torch.randint(5, 200, (2, 9))

    def loss_and_grads():
        model.zero_grad()
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        loss = logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reference, reference_grads = loss_and_grads()
    assert onednn_calls == []
    with cpu_matmul.frozen_linears(model):
        ours, grads = loss_and_grads()
    frozen = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    # each frozen layer's product, and the input gradient of each but the first layer's q, k and v projections (their
    # input, the embeddings, needs none)
    assert len(onednn_calls) == 2 * len(frozen) - 3
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)  # float32 rounding (0 to 5e-7 measured)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert not any("forward" in vars(m) for m in model.modules())  # every layer's own forward is back


def test_a_block_within_another_leaves_the_outer_blocks_layers_patched(reference_models, onednn_calls):
    """The passes of an update each enter frozen_linears inside the update's own block: the inner block patches
    nothing, and its exit leaves every layer on oneDNN until the outer block ends."""
    model, _ = reference_models["llama"]
    model = copy.deepcopy(model).requires_grad_(False)
    ids = torch.randint(5, 200, (1, 6))
    frozen = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), cpu_matmul.frozen_linears(model):
        with cpu_matmul.frozen_linears(model):
            model(input_ids=ids)
        assert len(onednn_calls) == frozen
        model(input_ids=ids)  # after the inner block: still oneDNN
        assert len(onednn_calls) == 2 * frozen
    model(input_ids=ids)
    assert len(onednn_calls) == 2 * frozen and not any("forward" in vars(m) for m in model.modules())


def test_padded_row_counts_by_hand():
    assert [cpu_matmul.padded_rows(n) for n in (0, 1, 16, 17, 18, 19, 31, 33, 300, 1000, 1024, 1025)] == \
        [0, 1, 16, 18, 18, 20, 32, 36, 320, 1024, 1024, 1152]


def test_onednn_meets_a_bounded_set_of_row_counts_and_the_results_stay_torchs(monkeypatch):
    """oneDNN keeps code for every shape it multiplies, for the life of the process (0.55 MB each): a server scoring
    contexts of every length met a new row count at almost every call. Products of 1 to 400 rows reach oneDNN as
    at most 16 + 8 per doubling row counts, each at most 12.5% above the rows given; forward values and input
    gradients equal torch's."""
    monkeypatch.setattr(cpu_matmul, "_choice", ["onednn"])
    seen, counts = [], set()
    real = cpu_matmul._pointwise

    def spy(x, weight, bias):
        seen.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_matmul, "_pointwise", spy)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    for rows in range(1, 401):
        seen.clear()
        x = torch.randn(rows, 24, requires_grad=True)
        ours = cpu_matmul.linear(x, weight, bias)
        assert ours.shape == (rows, 40)
        torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        if rows % 37 == 0:  # the input's gradient goes through the same padding
            grad = torch.randn(rows, 40)
            (mine,) = torch.autograd.grad(ours, x, grad)
            torch.testing.assert_close(mine, grad @ weight, atol=1e-5, rtol=1e-5)
        assert all(rows <= n <= max(16, rows * 1.125) for n in seen), (rows, seen)
        counts.update(seen)
    assert len(counts) <= 16 + 8 * 5, sorted(counts)  # 400 rows: five doublings above 16
