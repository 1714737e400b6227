"""What the trainer does to the tensors and gradients it hands out: a check that every gradient is finite, a guard
that makes ``loss.backward()`` on the trainer's outputs raise, the empty outputs of a throw-away pass, and an
updater's statistics made plain Python (no tensor leaves the rank), and torch.distributions' argument checks kept on
for the updater's code.

This module holds tensor helpers only; the trainer (:mod:`llmrl.engine.model.training.trainer`) decides when to use
them.
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.plugins.contracts import ForwardOutputs


def first_non_finite_gradient(module: torch.nn.Module) -> str | None:
    """The name and value kind of the first gradient with a NaN or infinite entry this rank holds, or None (one
    device synchronisation for all gradients)."""
    grads = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not grads:
        return None
    finite = torch.stack([torch.isfinite(g).all().to(grads[0][1].device) for _, g in grads])
    if bool(finite.all()):
        return None
    name, grad = grads[int((~finite).nonzero()[0])]
    return f"{name}: {'nan' if bool(torch.isnan(grad).any()) else 'inf'}"


class _Guard(torch.autograd.Function):
    """The identity, whose backward first calls ``check`` (the outputs' gradients are the first a backward pass
    computes, before any hook of DeepSpeed's on the model's own outputs)."""

    @staticmethod
    def forward(ctx, check, x):
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.check()
        return None, grad


def guarded(out: ForwardOutputs, check) -> ForwardOutputs:
    """``out`` with every tensor that has a gradient passed through :class:`_Guard`."""
    def guard(value):
        if isinstance(value, torch.Tensor):
            return _Guard.apply(check, value) if value.requires_grad else value
        if isinstance(value, dict):
            return {k: guard(v) for k, v in value.items()}
        return value

    return out._replace(**{k: guard(v) for k, v in out._asdict().items()})


def nothing_of(out: ForwardOutputs) -> ForwardOutputs:
    """The outputs of a throw-away pass, with every row removed (gradients still connect to the model)."""
    return out._replace(num_contexts=0,
                        heads={k: _none_of(v) for k, v in out.heads.items()},
                        **{k: _none_of(v) for k, v in out._asdict().items()
                           if k.startswith(("token_", "candidate_", "context_"))})


def _none_of(value):
    """``value`` (None, a tensor or a dict of tensors) with no row."""
    if isinstance(value, dict):
        return {k: v[:0] for k, v in value.items()}
    return None if value is None else value[:0]


def plain_stats(value):
    """Stats as plain Python (tensors become floats or lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): plain_stats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_stats(v) for v in value]
    return value


@contextlib.contextmanager
def distribution_checks():
    """torch.distributions' argument checks on (torch's default) while an updater runs. Importing PEFT, or compiling
    a step, patches torch once per process (``torch._dynamo``'s ``TorchPatcher``) and turns them off for the whole
    process: without this, an updater's ``Categorical`` over an empty or non-finite row would raise on a rank with
    no adapter and silently return NaN on a LoRA rank."""
    distribution = torch.distributions.Distribution
    before = distribution._validate_args
    distribution.set_default_validate_args(__debug__)
    try:
        yield
    finally:
        distribution.set_default_validate_args(before)
