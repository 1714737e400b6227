"""The optimizer of its own that an adapter created at run time steps with where DeepSpeed owns the step
(:mod:`llmrl.engine.model.training.own_optimizers`), on bfloat16 weights (their float32 masters kept apart): steps
equal torch AdamW over float32 masters cast into the weights after each step; clipping uses the adapter's own norm;
a recorded step is undone bit for bit; a saved state loaded into another optimizer steps on as the original; float16
gradients lose their loss scale, an overflow is dropped, and the scale follows DeepSpeed's dynamic rule for steps it
does not see (:mod:`llmrl.engine.model.training.loss_scale`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from llmrl.engine.model.training.own_optimizers import OwnOptimizer

SPEC = SimpleNamespace(type="adamw", lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, momentum=0.0)


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4, 6, generator=g).bfloat16().requires_grad_(True),
            "b": torch.randn(3, generator=g).bfloat16().requires_grad_(True)}


def gradients(k: int) -> dict:
    g = torch.Generator().manual_seed(100 + k)
    return {"a": torch.randn(4, 6, generator=g).bfloat16(), "b": torch.randn(3, generator=g).bfloat16()}


def step(own: OwnOptimizer, k: int, clip: float = 0.0, record=None) -> None:
    for key, p in own.params.items():
        p.grad = gradients(k)[key].clone()
    own.reduce_gradients(ranks=1)
    own.step({"lr": 2e-2 if k else 1e-2}, clip, record, "t")


def test_steps_equal_adamw_over_float32_masters_cast_into_bfloat16_weights():
    own = OwnOptimizer(weights(), SPEC)
    masters = {k: p.detach().float().clone().requires_grad_(True) for k, p in weights().items()}
    reference = torch.optim.AdamW(list(masters.values()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for k in range(3):
        step(own, k)
        for key, m in masters.items():
            m.grad = gradients(k)[key].float()
        reference.param_groups[0]["lr"] = 2e-2 if k else 1e-2
        reference.step()
    for key, m in masters.items():
        assert own.params[key].dtype == torch.bfloat16 and own.masters[key].dtype == torch.float32
        assert torch.equal(own.masters[key], m)  # the masters are not rounded to bfloat16 between steps
        assert torch.equal(own.params[key], m.bfloat16())
        assert own.params[key].grad is None and own.masters[key].grad is None


def test_clipping_uses_the_adapters_own_norm():
    own = OwnOptimizer(weights(), SPEC)
    step(own, 0, clip=0.5)
    norm = float(torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in gradients(0).values()])))
    assert abs(own.last_norm - norm) < 1e-4 * norm
    clipped = OwnOptimizer(weights(), SPEC)
    for key, p in clipped.params.items():
        p.grad = gradients(0)[key].float().mul(0.5 / (norm + 1e-6)).bfloat16()
    clipped.reduce_gradients(ranks=1)
    clipped.step({"lr": 1e-2}, 0.0, None, "t")
    for key in own.masters:  # (Adam's first step barely depends on the scale: compare the moments)
        torch.testing.assert_close(own.optimizer.state[own.masters[key]]["exp_avg"],
                                   clipped.optimizer.state[clipped.masters[key]]["exp_avg"], rtol=1e-2, atol=1e-6)


def test_a_recorded_step_is_undone_and_a_saved_state_steps_on_as_the_original():
    own = OwnOptimizer(weights(), SPEC)
    step(own, 0)
    state = own.state_dict()
    record: list = []
    step(own, 1, record=record)
    with torch.no_grad():  # undo as finite_steps.undo does: the tensors and their optimizer state
        for _, tensor, data, saved in record:
            tensor.copy_(data)
            own.optimizer.state[tensor] = saved
    loaded = OwnOptimizer(weights(seed=5), SPEC)
    loaded.load_state_dict(state)
    for key in own.masters:
        assert torch.equal(own.masters[key], loaded.masters[key])
    step(own, 2)
    step(loaded, 2)
    for key in own.masters:
        assert torch.equal(own.masters[key], loaded.masters[key])
        assert torch.equal(own.params[key], loaded.params[key])


def test_float16_gradients_are_unscaled_and_an_overflow_is_dropped():
    """``reduce_gradients(ranks, scale)`` divides by the loss scale (a gradient of 512 at a scale of 256 is 2); a
    gradient with an infinity is dropped, the masters untouched, and reported."""
    own = OwnOptimizer({"a": torch.zeros(3, requires_grad=True)}, SPEC)
    own.params["a"].grad = torch.tensor([512.0, -256.0, 0.0])
    assert own.reduce_gradients(ranks=1, scale=256.0) is True
    assert own.masters["a"].grad.tolist() == [2.0, -1.0, 0.0]
    own.params["a"].grad = torch.tensor([1.0, float("inf"), 0.0])
    assert own.reduce_gradients(ranks=1, scale=256.0) is False
    assert own.params["a"].grad is None and own.masters["a"].grad is None and own.last_norm is None


class _Float16Engine:
    """What :func:`after_own_step` reads of a DeepSpeed engine in float16 with a dynamic loss scale."""

    def __init__(self, scale: float, window: int, dynamic: bool = True):
        self.optimizer = SimpleNamespace(loss_scale=scale)
        self.window, self.dynamic = window, dynamic

    def fp16_enabled(self):
        return True

    def dynamic_loss_scale(self):
        return self.dynamic

    def dynamic_loss_scale_args(self):
        return {"scale_window": self.window, "min_scale": 4.0}


def test_own_steps_alone_halve_the_scale_on_overflow_and_double_it_after_a_window_without_one():
    from llmrl.engine.model.training.loss_scale import after_own_step

    engine, run_time = _Float16Engine(scale=16.0, window=3), SimpleNamespace(steps_without_overflow=0)
    seen = []
    for overflow in (True, True, True, False, False, False, False, False, False, True):
        after_own_step(engine, run_time, overflow)
        seen.append(engine.optimizer.loss_scale)
    assert seen == [8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 8.0]  # not below min_scale 4; x2 every 3 clean
    static = _Float16Engine(scale=16.0, window=3, dynamic=False)
    after_own_step(static, run_time, True)
    assert static.optimizer.loss_scale == 16.0  # fp16.loss_scale > 0: DeepSpeed keeps it, and so does llmrl
