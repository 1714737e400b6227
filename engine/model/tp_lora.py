"""LoRA adapters over a tensor-parallel base model (``tensor_parallel`` > 1 with LoRA, at every ZeRO stage).

DeepSpeed's AutoTP replaces a model's linear layers by sharded ones when the engine is built. A PEFT LoRA layer
holds its base linear inside, and stands where the base linear stood, so AutoTP would replace the LoRA layer whole
by a sharded copy of its base weight and drop the adapters without a word. :func:`lora_set_aside` prevents that:
while the engine is built, each LoRA layer's base linear stands in its place (AutoTP shards it as it would without
LoRA), and the LoRA layer waits in a list on the model, so its weights are still the engine's and its optimizer's.
Afterwards the LoRA layer goes back, over the sharded base layer.

An adapter's A and B stay whole on every rank (they are small: rank x features). Each rank applies the part its base
shard needs (:class:`AdapterPart`):
  - base split by output features (column-parallel): B's rows of this rank's outputs; A whole, and its output's
    gradient summed over the tensor-parallel ranks (each rank's rows of B give one part of it);
  - base split by input features, its output summed over the ranks (row-parallel): A's columns of this rank's
    inputs, A's output summed over the ranks; B whole;
  - base not split, or its output gathered whole: the adapter as it is.
A part leaves a gradient in its own rows or columns only: that weight's gradient is summed over the tensor-parallel
ranks in the backward pass of each use, so every rank of a replica holds the same, whole gradient and steps the same
weights. DeepSpeed counts a parameter that is not split for tensor parallelism on one rank of each group when it
takes the gradient norm. Because the weights stay whole, whatever reads or writes them (snapshots, ``save_adapter``,
weight sync, checkpoints, the optimizers of adapters created at run time) works as it does without tensor
parallelism; :func:`split_new_adapter` gives an adapter added later (created at run time, or a snapshot) its parts.
Under ZeRO-3 the configured adapter is partitioned over the replicas like any weight the engine was built with: a
part is the PEFT linear itself (:meth:`AdapterPart.of`), so the hooks ZeRO-3 put on it gather its weight whole for
each pass.

Not supported, each refused by name: LoRA with a bias or a variant (DoRA), base layers AutoTP splits in pieces that
are not one contiguous block (fused projections). This module changes no weight's value.
"""

from __future__ import annotations

import contextlib

import torch

HOLDING = "llmrl_lora_set_aside"  # the model's attribute holding the LoRA layers while the engine is built


class _SumGradient(torch.autograd.Function):
    """The identity forward; the backward sums the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """The forward sums ``x`` over ``group``; the backward is the identity (every rank's part had the same weight)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AdapterPart(torch.nn.Linear):
    """One LoRA matrix (``lora_A`` or ``lora_B`` of one adapter), whole, applied to this rank's part: the rows
    ``start:start+size`` of ``dim`` 0 (outputs) or the columns of ``dim`` 1 (inputs) of its weight, its output summed
    over ``group`` (``sum_output``) or its output's gradient summed (``sum_gradient``).

    :meth:`of` makes the PEFT linear itself a part (it changes the object's class), so the parameter's name, value
    and optimizer state stay the adapter's, and so do the hooks ZeRO-3 put on that module to gather its weight for
    each pass."""

    group = None
    dim: int | None = None
    start = size = 0
    sum_output = sum_gradient = False

    @classmethod
    def of(cls, linear: torch.nn.Linear, group, dim: int | None = None, start: int = 0, size: int = 0,
           sum_output: bool = False, sum_gradient: bool = False) -> AdapterPart:
        """``linear`` (a plain ``nn.Linear`` without bias), made a part in place; returned."""
        if type(linear) is not torch.nn.Linear or linear.bias is not None:
            raise TypeError(f"an adapter part is made of a torch.nn.Linear without bias, not {linear!r}")
        linear.__class__ = cls
        linear.group, linear.dim, linear.start, linear.size = group, dim, start, size
        linear.sum_output, linear.sum_gradient = sum_output, sum_gradient
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.dim is not None:  # the gradient of a part is in its rows or columns only: summed, it is the whole's
            if weight.requires_grad and torch.is_grad_enabled():
                weight = _SumGradient.apply(weight, self.group)
            weight = weight.narrow(self.dim, self.start, self.size)
        out = torch.nn.functional.linear(x, weight)
        if self.sum_output:
            out = _SumForward.apply(out, self.group)
        if self.sum_gradient and torch.is_grad_enabled():
            out = _SumGradient.apply(out, self.group)
        return out

    def extra_repr(self) -> str:
        part = "whole" if self.dim is None else f"{'rows' if self.dim == 0 else 'columns'} " \
                                                  f"{self.start}:{self.start + self.size}"
        return f"{self.in_features}, {self.out_features}, {part}"


def is_split(layer) -> bool:
    """Whether a PEFT LoRA layer's base layer is split over tensor-parallel ranks (its adapters hold parts)."""
    return any(isinstance(part, AdapterPart) for part in (*layer.lora_A.values(), *layer.lora_B.values()))


class OrderedRows:
    """A split LoRA layer's ``forward`` while the rows of a ``generate`` pass read different adapters
    (:class:`~llmrl.engine.model.row_adapters.RowAdapters` puts it in place): each adapter's rows in the call's order.
    PEFT's own mixed-batch forward walks the adapters as a ``set``, whose order differs from process to process; a
    row-split layer sums each adapter's part over the ranks, so ranks walking in other orders would add one adapter's
    part to another's."""

    same_without_grad = True  # (the written-out decode step calls the layer as a module: this forward runs there)

    def __init__(self, layer, rows):
        self.layer, self.rows = layer, rows

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        result = layer.base_layer(x, *args, **kwargs)
        groups = self.rows.groups_of_rows(x.shape[0], x.device)
        for name, members in zip(groups.adapters, groups.members):  # the same on every rank of the replica
            if name not in layer.lora_A:
                continue
            a, b = layer.lora_A[name], layer.lora_B[name]
            part = x.index_select(0, members).to(a.weight.dtype)
            delta = b(a(layer.lora_dropout[name](part))) * layer.scaling[name]
            result = result.index_add(0, members, delta.to(result.dtype))
        return result


def _lora_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in module.named_modules() if isinstance(m, LoraLayer)]


def _parent(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


@contextlib.contextmanager
def lora_set_aside(module: torch.nn.Module, tensor_parallel: int):
    """Around the engine's construction: each LoRA layer's base linear in its place, the LoRA layers in a list on
    ``module``; then each back over its (sharded) base layer, its adapters split (:func:`split_adapter`). Nothing
    is done when ``tensor_parallel`` is 1 or the model holds no LoRA layer."""
    layers = _lora_layers(module) if tensor_parallel > 1 else []
    if not layers:
        yield
        return
    placed = []
    for name, layer in layers:
        parent, attr = _parent(module, name)
        setattr(parent, attr, layer.base_layer)
        placed.append((name, parent, attr, layer))
    module.add_module(HOLDING, torch.nn.ModuleList([layer for *_, layer in placed]))
    built = False
    try:
        yield
        built = True
    finally:
        del module._modules[HOLDING]
        for _, parent, attr, layer in placed:
            if built:
                layer.base_layer = getattr(parent, attr)  # the sharded layer AutoTP put there
            setattr(parent, attr, layer)
    for name, _, _, layer in placed:
        for adapter in list(layer.lora_A):
            split_adapter(layer, adapter, name)


def built_engine(module: torch.nn.Module, tensor_parallel: int, **initialize):
    """``deepspeed.initialize(model=module, **initialize)`` with the LoRA layers set aside (:func:`lora_set_aside`);
    the engine."""
    import deepspeed

    with lora_set_aside(module, tensor_parallel):
        engine, *_ = deepspeed.initialize(model=module, **initialize)
    if tensor_parallel > 1:
        renamed(engine)
    return engine


def renamed(engine) -> None:
    """Give DeepSpeed's names of the parameters (``engine.param_names``, which its ZeRO optimizers share) the LoRA
    weights' names in place, after :func:`lora_set_aside` (built while they sat in the list)."""
    names = {param: name for name, param in engine.module.named_parameters()}
    engine.param_names.clear()
    engine.param_names.update(names)


def split_new_adapter(model: torch.nn.Module, adapter: str) -> None:
    """Give ``adapter`` (just added by PEFT) its parts in every LoRA layer over a tensor-parallel base layer."""
    for name, layer in _lora_layers(model):
        if adapter in layer.lora_A and not isinstance(layer.lora_A[adapter], AdapterPart):
            split_adapter(layer, adapter, name)


def check_split_targets(model: torch.nn.Module, targets, who: str) -> None:
    """Refuse a new adapter's ``targets`` (module names) that name a layer AutoTP split which no LoRA layer wraps:
    PEFT wraps whole linears only."""
    from peft.tuners.lora import LoraLayer

    names = [targets] if isinstance(targets, str) else list(targets or [])
    for name, module in model.named_modules():
        split = not isinstance(module, (torch.nn.Linear, LoraLayer)) and hasattr(module, "mp_group")
        if split and any(name == t or name.endswith(f".{t}") for t in names):
            raise ValueError(f"{who}: {name} is split over the tensor-parallel ranks and adapted by no configured "
                             "LoRA adapter; a new adapter adapts the layers the configured adapter adapts (add it to "
                             "that adapter's target_modules) or layers left whole")


def split_adapter(layer, adapter: str, name: str) -> None:
    """Replace ``adapter``'s A and B in ``layer`` by the parts this rank applies (see the module doc); nothing
    when the base layer is whole."""
    base = layer.base_layer
    shape = _split_of(base, name)
    if shape is None:
        return
    if getattr(layer, "lora_bias", {}).get(adapter, False) or adapter in getattr(layer, "lora_variant", {}):
        raise ValueError(f"LoRA layer {name} of adapter {adapter!r} has a bias or a variant (DoRA), which llmrl does "
                         "not split for tensor parallelism: use plain LoRA (lora_bias false, use_dora false)")
    kind, start, size, group = shape
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    if kind == "column":
        AdapterPart.of(a, group, sum_gradient=True)
        AdapterPart.of(b, group, dim=0, start=start, size=size)
    else:
        AdapterPart.of(a, group, dim=1, start=start, size=size, sum_output=True)


def _split_of(base, name: str) -> tuple[str, int, int, object] | None:
    """``("column" or "row", start, size, group)``: how AutoTP split ``base``; None when it is whole on this rank."""
    if isinstance(base, torch.nn.Linear):
        return None
    from deepspeed.module_inject.layers import LinearAllreduce, LinearAllreduceWithReplicatedInput, LinearLayer

    kinds = {LinearLayer: ("column", 0), LinearAllreduce: ("row", 1)}
    if type(base) is LinearAllreduceWithReplicatedInput or (type(base) is LinearLayer and base.gather_output):
        return None  # whole inputs and whole outputs: the adapter applies as it is
    if type(base) not in kinds:
        raise ValueError(f"LoRA layer {name} wraps a {type(base).__name__}, which DeepSpeed's tensor parallelism "
                         "split in a way llmrl does not split adapters for: leave that layer out of the adapter's "
                         "target_modules, or use replicas instead of tensor_parallel")
    kind, dim = kinds[type(base)]
    sizes, index = list(base._partition_sizes), base.tp_index
    shape = getattr(base.weight, "ds_shape", base.weight.shape)  # (ZeRO-3 partitions it over the replicas)
    if shape[dim] != sizes[index]:
        raise ValueError(f"LoRA layer {name}: its base weight holds {shape[dim]} of {sum(sizes)} "
                         f"features on this rank, where DeepSpeed's partition says {sizes[index]}")
    return kind, sum(sizes[:index]), sizes[index], base.mp_group
