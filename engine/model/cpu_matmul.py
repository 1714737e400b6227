"""Float32 products with frozen weights on a CPU, through oneDNN where it beats torch's default (``cpu_matmul``).

torch multiplies float32 matrices on a CPU with MKL's ``sgemm``. On AMD CPUs MKL takes a generic path: on an AMD EPYC
(Zen 4) machine of this project's kind the products of a 135M model's passes (300-600 rows) ran at 120-190 GFLOP/s
through MKL and at 190-215 through oneDNN (``mkldnn._linear_pointwise``, the op of Inductor's CPU freezing, called on
the weight as it is: nothing is copied or kept), and the output layer's 2x faster at a few dozen rows. So on a server
rank whose ``cpu_matmul`` is ``onednn`` (``auto``: on AMD CPUs), the frozen float32 ``nn.Linear`` layers of the model
multiply through oneDNN in scoring passes (:func:`llmrl.engine.model.forward.run_forward`) and throughout ``update``
and ``forward_backward`` calls (forward and backward passes, and layers recomputed by activation checkpointing), and
so does the chunked output layer (:mod:`llmrl.engine.model.scoring.vocab_chunks`) wherever it runs: the forward
product, and in a backward pass the input's gradient (the gradient times the weight, again through oneDNN). Both
kernels compute the same sums and round differently (float32 rounding: a relative 1e-6). oneDNN keeps code for every
shape it has multiplied, for the life of the process, so every product's rows are padded to one of a bounded set of
row counts (:func:`on_bounded_rows`; decoding's oneDNN packs go through it too).

It does not touch: trainable weights (their own gradient is torch's), other dtypes and devices, subclasses of
``nn.Linear`` with a forward of their own, layers whose forward another library replaced, weights that are not 2-D
(ZeRO-3's partitions). Decoding packs its weights itself (:mod:`llmrl.engine.model.decoding.packed_linears`), and
reads which CPU this is (:func:`cpu_vendor`) and whether oneDNN exists (:func:`onednn_available`) from here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

CHOICES = ("auto", "torch", "onednn")
_choice = ["auto"]  # this process's setting (a server rank sets its config's cpu_matmul at start)
_products = [0]  # products run through oneDNN in this process
_patched_models: set[int] = set()  # models whose layers frozen_linears patched, for the block's duration


def configure(choice: str) -> None:
    """Set this process's kernel for frozen float32 products: ``auto``, ``torch`` or ``onednn``."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_matmul {choice!r}: expected one of {', '.join(CHOICES)}")
    _choice[0] = choice


def setting() -> str:
    """This process's ``cpu_matmul`` setting (``auto`` until a server rank configures it)."""
    return _choice[0]


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``AuthenticAMD``, ``GenuineIntel``), or '' where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_active() -> bool:
    """Whether frozen float32 products on a CPU run through oneDNN in this process."""
    choice = _choice[0]
    if choice == "torch" or not onednn_available():
        return False
    return choice == "onednn" or cpu_vendor() == "AuthenticAMD"


def _frozen_cpu_float32(weight) -> bool:
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and not weight.requires_grad)


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and _frozen_cpu_float32(weight)


def stats() -> dict:
    """Whether this process multiplies frozen float32 weights through oneDNN, and how many such products ran
    (``server_memory()[rank]["cpu_matmul"]``)."""
    return {"onednn": onednn_active(), "onednn_products": _products[0]}


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _products[0] += 1
    return on_bounded_rows(lambda rows: _pointwise(rows, weight, bias), x)


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def padded_rows(rows: int) -> int:
    """The row count oneDNN multiplies for ``rows`` rows: ``rows`` itself up to 16, else ``rows`` rounded up to a
    multiple of an eighth of its power of two (at most 12.5% more rows; eight counts per doubling)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def on_bounded_rows(op, x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for a row-wise product ``op`` (a linear layer's), run on ``x``'s rows padded with zero rows up to
    :func:`padded_rows`. oneDNN builds code for every shape it multiplies and keeps it for the life of the process:
    measured on an AMD EPYC, 0.55 MB of resident memory per new row count, with its primitive cache at any capacity
    (``python -m benchmarks.onednn_rows``); a server scoring contexts of every length grew by hundreds of MB. With
    the padding, a process meets at most 16 + 8 row counts per doubling; the padded rows cost at most 12.5% more
    work and are cut from the result (a view of its first rows)."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    target = padded_rows(rows)
    if target == rows:
        return op(x)
    flat = torch.nn.functional.pad(x.reshape(rows, width), (0, 0, 0, target - rows))
    out = op(flat)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _FrozenLinear(torch.autograd.Function):
    """x W^T + b with W and b frozen: the input's gradient is the output's gradient times W."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return _product(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return _product(grad.contiguous(), weight.t(), None), None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear``, through oneDNN where this process uses it and the weight is frozen."""
    if not onednn_active():
        return torch.nn.functional.linear(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear` once oneDNN is known to be in use: its product where the operands allow it."""
    if not (_applies(x, weight) and (bias is None or not bias.requires_grad)):
        return torch.nn.functional.linear(x, weight, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FrozenLinear.apply(x, weight, bias)
    return _product(x, weight, bias)


def times_weight(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad @ weight`` (an input's gradient through a frozen linear layer), through oneDNN where this process uses
    it."""
    if onednn_active() and _applies(grad, weight) and not torch.is_grad_enabled():
        return _product(grad.contiguous(), weight.t(), None)
    return grad @ weight


@contextlib.contextmanager
def frozen_linears(model: torch.nn.Module):
    """Within the block, the frozen float32 linear layers of ``model`` multiply through :func:`linear` (nothing
    changes where this process does not use oneDNN). Every layer's own ``forward`` is back on exit. A block within
    another over the same model (the passes of an update) finds its layers patched already and does nothing."""
    if not onednn_active() or id(model) in _patched_models:
        yield
        return
    patched = []
    _patched_models.add(id(model))
    try:
        for module in model.modules():
            if (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
                    and "forward" not in vars(module) and _frozen_cpu_float32(getattr(module, "weight", None))):
                module.forward = _forward(module)
                patched.append(module)
        yield
    finally:
        _patched_models.discard(id(model))
        for module in patched:
            vars(module).pop("forward", None)


def _forward(layer: torch.nn.Linear):
    def forward(x):  # patched only while oneDNN is in use: its operands alone are checked
        return _onednn_linear(x, layer.weight, layer.bias)

    return forward
