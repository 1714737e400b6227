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
