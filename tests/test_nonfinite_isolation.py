"""One adapter's non-finite values reach no other adapter: the gradient anchor (a zero tied to every trainable
weight, added to every training output) is exactly 0, with exactly zero gradients, whatever a weight holds; and
``optim_step`` refuses AdamW settings whose decay ``1 - learning_rate * weight_decay`` flips the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl import InvalidArgument
from llmrl.engine.config.types import OptimizerConfig
from llmrl.engine.model.forward import gradient_anchor
from llmrl.engine.requests.optim_step import check_step_settings


def served_with(**weights) -> SimpleNamespace:
    module = torch.nn.Module()
    for name, value in weights.items():
        module.register_parameter(name, torch.nn.Parameter(value))
    engine = SimpleNamespace(zero_optimization_partition_weights=lambda: False)
    return SimpleNamespace(engine=engine, module=module)


def test_the_anchor_is_an_exact_zero_with_zero_gradients_beside_a_nan_or_inf_weight():
    nan, inf = float("nan"), float("inf")
    served = served_with(a=torch.tensor([0.5, -2.0, 3.0]), b=torch.tensor([[nan, 1.0], [2.0, nan]]),
                         c=torch.tensor([inf, -inf]))
    anchor = gradient_anchor(served)
    assert anchor.dim() == 0 and anchor.item() == 0.0  # NaN * 0 would be NaN
    x = torch.tensor([1.0, 2.0, -4.0])
    loss = (served.module.a * x).sum() + anchor
    loss.backward()
    assert torch.equal(served.module.a.grad, x)  # d/da of sum(a * x), by hand
    for name in ("b", "c"):  # every weight gets a gradient (the anchor's purpose): zero, finite
        grad = getattr(served.module, name).grad
        assert grad is not None and torch.equal(grad, torch.zeros_like(grad))
    served.module.zero_grad()
    (gradient_anchor(served) * nan).backward()  # a non-finite gradient from the loss stops at the anchor too
    for p in served.module.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))


def test_adamw_settings_whose_decay_flips_the_weights_are_refused_naming_the_field():
    adamw = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    with pytest.raises(InvalidArgument, match=r"adam_params\['learning_rate'\] x adam_params\['weight_decay'\] is "
                                              r"1e\+40.*1 - learning_rate x weight_decay"):
        check_step_settings({"learning_rate": 1e20, "weight_decay": 1e20}, adamw)
    with pytest.raises(InvalidArgument, match=r"adam_params\['learning_rate'\] x the config's weight_decay "
                                              r"\(training.optimizer.weight_decay: 0.01\) is 1000"):
        check_step_settings({"learning_rate": 1e5}, adamw)
    with pytest.raises(InvalidArgument, match=r"the config's learning_rate \(training.optimizer.lr: 0.001\) x "
                                              r"adam_params\['weight_decay'\] is 1:"):
        check_step_settings({"weight_decay": 1000.0}, adamw)
    assert check_step_settings({"learning_rate": 0.5, "weight_decay": 1.9}, adamw) == {
        "learning_rate": 0.5, "weight_decay": 1.9}  # 0.95 < 1
    # Adam adds the decay to the gradient (it cannot flip a weight): not refused; nor with the type alone
    assert check_step_settings({"learning_rate": 1e20, "weight_decay": 1e20}, OptimizerConfig(type="adam"))
    assert check_step_settings({"learning_rate": 1e20, "weight_decay": 1e20}, "adam")


def adapters_model() -> torch.nn.Module:
    """Two adapters' LoRA-named weights, as PEFT names them."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    for kind in ("lora_A", "lora_B"):
        container = torch.nn.Module()
        for adapter in ("x", "y"):
            part = torch.nn.Module()
            part.weight = torch.nn.Parameter(torch.randn(3, 4, generator=g))
            container.add_module(adapter, part)
        layer.add_module(kind, container)
    model = torch.nn.Module()
    model.add_module("q_proj", layer)
    return model


def served_training(model, adapters=("x", "y")) -> SimpleNamespace:
    from llmrl.engine.model.served_state import RunTimeAdapters
    from llmrl.engine.model.training.optimizer import AdapterSteps, param_groups

    optimizer = torch.optim.AdamW(param_groups(model, list(adapters)), lr=1e-2, weight_decay=0.1)
    return SimpleNamespace(adapter_steps=AdapterSteps(optimizer), adapters=list(adapters), module=model,
                           engine=SimpleNamespace(optimizer=optimizer), role=SimpleNamespace(replica=0),
                           llm=SimpleNamespace(name="m", replicas=1), run_time=RunTimeAdapters())


def stepped(served, adapter: str, grads: dict, lr: float, votes: list):
    """One step of ``adapter`` as the trainer takes it (grads by parameter name), checked after it; ``votes``
    collects what the rank voted."""
    from llmrl.engine.model.training.finite_steps import copied_step, keep_finite

    for name, p in served.module.named_parameters():
        p.grad = grads[name].clone() if name in grads else None
    for group in served.adapter_steps.optimizer.param_groups:
        group["lr"] = lr
    trainer = SimpleNamespace(served=served, optimizer_steps=0, failed_vote_cast=False)
    with served.adapter_steps.only({adapter}), copied_step(served, {adapter}) as copy:
        served.adapter_steps.optimizer.step()
    keep_finite(trainer, copy, lambda bad: votes.append(bad) or bad)


def test_a_step_that_leaves_a_non_finite_moment_or_stops_half_way_is_undone_and_the_next_equals_plain_adamw():
    """Gradients of 1e25 are finite, and their square overflows Adam's second moment; lr 1e300 is a finite number,
    and torch refuses it half-way through the step (after advancing the step count). Both steps are undone
    (weights, moments, step counts), the first named with its adapter, and the adapter's next step equals plain
    AdamW's first step; the other adapter is untouched."""
    from llmrl.engine.model.training.finite_steps import NonFiniteUpdate

    served = served_training(adapters_model())
    params = dict(served.module.named_parameters())
    start = {k: p.detach().clone() for k, p in params.items()}
    g = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(3, 4, generator=g) for k in params if ".x." in k}
    votes = []
    with pytest.raises(NonFiniteUpdate, match=r"optimizer step 1 left a value that is not finite on replica 0 "
                                              r"\(adapter 'x''s optimizer state exp_avg_sq \(\(3, 4\)\): inf\): "
                                              r"the step was undone on every replica \(adapter\(s\) \['x'\] hold"):
        stepped(served, "x", {k: v * 1e25 for k, v in grads.items()}, 1e-2, votes)
    assert votes == [1]  # replicas - replica 0: the first bad replica, for every rank to undo
    with pytest.raises(RuntimeError, match=r"overflow.*; the optimizer step stopped half-way and was undone "
                                           r"\(adapter\(s\) \['x'\] hold the weights"):
        stepped(served, "x", grads, 1e300, votes)
    for k, p in params.items():
        assert torch.equal(p, start[k]), k
    assert all(not served.adapter_steps.optimizer.state.get(p) for p in params.values())  # no moment, no count
    assert served.run_time.versions == {}  # an undone step is no policy version
    stepped(served, "x", grads, 1e-2, votes)
    assert votes == [1, 0]
    assert served.run_time.versions == {"x": 1}  # the kept step is x's first
    plain = {k: torch.nn.Parameter(v.clone()) for k, v in start.items() if ".x." in k}
    reference = torch.optim.AdamW(list(plain.values()), lr=1e-2, weight_decay=0.1)
    for k, p in plain.items():
        p.grad = grads[k].clone()
    reference.step()
    for k, p in params.items():
        want = plain[k] if k in plain else start[k]  # y: bit-identical
        torch.testing.assert_close(p.detach(), want.detach(), atol=0, rtol=0)
