"""Linear layers packed once for a CPU's matmul kernel, for decoding (``generation.pack_weights``).

On a CPU a decode step of a small model is mostly matmuls of a few dozen rows against each weight, and at 32 rows
MKL's ``sgemm`` spends about a third of its time re-packing the weight for its kernel at every call. MKL can pack a
weight once for a given row count (``cblas_sgemm_pack``, through torch's ``mkl._mkl_reorder_linear_weight`` and
``mkl._mkl_linear``, the ops Inductor's CPU freezing uses); a matmul of exactly that many rows then skips the
re-packing: 1.3x-1.9x faster for a 135M model's shapes at 32 rows. Its kernel may round a dot product differently
(decoded log-probs 2.4e-6 apart at most in ``tests/test_packed_linears.py``, 0 in the benchmark's 32-row shape).

On AMD CPUs MKL's ``sgemm`` takes a slower generic path: on an AMD EPYC (Zen 4) machine of this project's kind, a
32-row product with a 135M model's weights ran at 70-140 GFLOP/s through MKL, packed or not, and at 180-210 through
oneDNN with the weight reordered once (``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``, again the
ops of Inductor's CPU freezing); at 4 rows 3x faster. oneDNN's reordered weight serves every row count, so there the
prefill multiplies with it too. ``kernel``: ``mkl`` (packs per row count) or ``onednn`` (one pack);
:func:`default_kernel` picks oneDNN on AMD CPUs and MKL on others. Both compute x W^T + b; they round differently.

:meth:`PackedWeights.for_rows` points the ``forward`` of each float32 ``torch.nn.Linear`` of a model at the packed
product for the duration of one decoding batch; with MKL, inputs of any other row count (the prefill) run the layer's
own ``forward``. A layer is packed the first time it multiplies that many rows, and on exit (an error included) every
layer's own ``forward`` is back.

Packing costs about as much as a decode step's matmuls, so packs are kept across calls, and only where it is known
when their weight changes:
  - a frozen weight (``requires_grad`` False): kept while the layer's weight is the same memory (the pack holds a
    view of it, so that memory cannot be reused by another tensor) and its version counter (bumped by every in-place
    write through the parameter, as ``load_state_dict`` writes) is unchanged;
  - a weight whose memory belongs to an *owner* the caller names (the merged LoRA buffers of
    :mod:`.merged_lora`, swapped in through ``.data``): kept while the owner's version counter is unchanged;
  - a trainable weight is not packed: optimizers and DeepSpeed write such weights in ways no counter sees, and a
    layer not packed in a call (a weight made trainable) loses the packs it had.
A pack is kept against the parameter (or owner) object itself: another parameter over the same memory is packed again.
MKL's packs of the last two row counts are kept, so they can hold up to twice the weights' size (oneDNN's pack: once).
A frozen weight written in place through ``.data`` (bypassing the parameter's version counter) would be read stale;
nothing in llmrl writes frozen weights so. Under ZeRO-3 the weights are gathered for each call into memory freed
after it: :meth:`PackedWeights.keep_only` lets the caller drop those packs at the call's end (kept, a pack would hold
the gathered weight's memory between calls). Not packed either: subclasses of ``nn.Linear`` with a ``forward`` of their
own, other dtypes and devices, weights that are not 2-D (ZeRO-3's partitions), torch builds without the kernel. This
module does not decode; :mod:`.loop` runs the steps.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from llmrl.engine.model import cpu_matmul

KERNELS = ("mkl", "onednn")


def available(kernel: str = "mkl") -> bool:
    """Whether this torch build can pack weights for ``kernel`` (an x86 build with MKL, or with oneDNN)."""
    if kernel == "onednn":
        return cpu_matmul.onednn_available()
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def default_kernel() -> str | None:
    """The kernel ``pack_weights: auto`` packs for: the one ``cpu_matmul`` names (MKL for ``torch``, whose default
    kernel it is), or, under ``auto``, oneDNN on AMD CPUs and MKL on others; None where neither exists."""
    setting = cpu_matmul.setting()
    onednn_first = setting == "onednn" or (setting == "auto" and cpu_matmul.cpu_vendor() == "AuthenticAMD")
    preferred = ("onednn", "mkl") if onednn_first else ("mkl", "onednn")
    return next((kernel for kernel in preferred if available(kernel)), None)


@dataclass
class _Pack:
    module: weakref.ref
    identity: weakref.ref  # the parameter (frozen weights) or the owner whose version counter is read
    holder: torch.Tensor  # the memory packed, kept allocated so that no other tensor can take its address
    version: int  # the version counter when packed
    rows: int
    packed: torch.Tensor
    nbytes: int  # the weight's size: what the pack holds in memory (MKL reserves more address space than it fills)

    def fits(self, module, counter: torch.Tensor, identity, rows: int) -> bool:
        weight = module.weight
        return (self.module() is module and self.identity() is identity and self.rows == rows
                and self.version == counter._version and self.holder.data_ptr() == weight.data_ptr()
                and self.holder.shape == weight.shape and self.holder.dtype == weight.dtype)


class PackedWeights:
    """The packs of one served model, kept across decoding calls (see the module's docstring)."""

    def __init__(self, kernel: str = "mkl", keep_row_counts: int = 2):
        if kernel not in KERNELS:
            raise ValueError(f"pack_weights kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
        self.kernel = kernel  # mkl: a pack per row count; onednn: one pack for every row count (kept as rows 0)
        self._kept: dict[tuple[int, int], _Pack] = {}  # (id of the layer, rows) -> its pack
        self._recent_rows: list[int] = []  # the last few row counts packed for, the newest last
        self.keep_row_counts = keep_row_counts
        self.packs = 0  # how many weights were packed (for tests and statistics)

    def held_bytes(self) -> int:
        """The memory the kept packs hold between calls."""
        return sum(p.nbytes for p in self._kept.values())

    def keep_only(self, kept) -> None:
        """Drop every pack but those for which ``kept(layer, memory packed)`` is true (the caller knows which memory
        outlives a call: ZeRO-3's gathered weights do not)."""
        self._kept = {key: pack for key, pack in self._kept.items()
                      if (layer := pack.module()) is not None and kept(layer, pack.holder)}

    @contextlib.contextmanager
    def for_rows(self, model, rows: int, owners: dict[int, torch.Tensor] | None = None):
        """Within the block, linear layers of ``model`` multiply inputs of ``rows`` rows with packed weights.
        ``owners``: for weights whose memory another object swapped in and writes (by ``data_ptr``), the tensor
        whose version counter tracks those writes."""
        if rows < 1 or not available(self.kernel):
            yield
            return
        if self.kernel == "onednn":
            rows = 0  # its pack serves every row count
        owners = owners or {}
        if rows in self._recent_rows:
            self._recent_rows.remove(rows)
        self._recent_rows = (self._recent_rows + [rows])[-self.keep_row_counts:]
        patched = []
        try:
            for module in model.modules():
                source = self._source(module, owners)
                if source is not None:
                    module.forward = self._forward(module, *source, rows)
                    patched.append(module)
            # dropped: packs of an older row count, and of a layer not packed now (made trainable, or gone)
            mine = {id(module) for module in patched}
            self._kept = {key: pack for key, pack in self._kept.items()
                          if key[1] in self._recent_rows and key[0] in mine}
            yield
        finally:
            for module in patched:
                vars(module).pop("forward", None)

    @staticmethod
    def _source(module, owners: dict) -> tuple | None:
        """What a pack of this layer's weight is kept against: the tensor whose version counter counts the writes
        to it, and the object that counter belongs to; None where the layer is not packed."""
        weight = getattr(module, "weight", None)
        if not (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
                and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.numel() > 0):
            return None  # (a subclass with a forward of its own computes something else than x W^T + b)
        if "forward" in vars(module):
            return None  # a forward already replaced (by a hook library) is left alone
        owner = owners.get(weight.data_ptr())
        if owner is not None:
            return owner, owner
        # detach shares the parameter's version counter
        return None if weight.requires_grad else (weight.detach(), weight)

    def _forward(self, layer: torch.nn.Linear, counter: torch.Tensor, identity, rows: int):
        own = type(layer).forward.__get__(layer)
        key = (id(layer), rows)
        onednn = self.kernel == "onednn"
        checked = []  # the pack, once checked in this call

        def pack() -> _Pack:
            if not checked:
                pack = self._kept.get(key)
                if pack is None or not pack.fits(layer, counter, identity, rows):
                    weight = layer.weight.detach()
                    packed = (torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn
                              else torch.ops.mkl._mkl_reorder_linear_weight(weight, rows))
                    pack = self._kept[key] = _Pack(weakref.ref(layer), weakref.ref(identity), weight,
                                                   counter._version, rows, packed,
                                                   weight.numel() * weight.element_size())
                    self.packs += 1
                checked.append(pack)
            return checked[0]

        def forward(x):
            if x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
                return own(x)  # a dtype the pack does not take, or a product to differentiate (the packed ops cannot)
            if onednn:  # any row count (the prefill's too), padded to one of a bounded set: see on_bounded_rows
                packed = pack().packed
                return cpu_matmul.on_bounded_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(
                    rows, packed, layer.bias, "none", [], ""), x)
            if x.numel() != rows * x.shape[-1]:
                return own(x)  # another row count (the prefill)
            return torch.ops.mkl._mkl_linear(x, pack().packed, layer.weight, layer.bias, rows)

        def product():
            """The packed product alone, for a caller whose every input is ``rows`` float32 rows (packed now)."""
            packed, weight, bias = pack().packed, layer.weight, layer.bias
            if onednn:
                op = torch.ops.mkldnn._linear_pointwise.default
                return lambda x: op(x, packed, bias, "none", [], "")
            op = torch.ops.mkl._mkl_linear.default
            return lambda x: op(x, packed, weight, bias, rows)

        forward.product = product
        return forward
