"""A LoRA layer's adapters applied to the rows of a pass that each name their own, in two batched products (as
Punica's segmented products apply many adapters to one batch): the rows gathered by adapter into a padded block, one
batched product with the adapters' A matrices stacked, one with their B matrices, each row's result added to the
base layer's output for that row.

:class:`StackedLora` stands in for a PEFT ``lora.Linear`` layer's ``forward`` while a
:class:`~llmrl.engine.model.row_adapters.RowAdapters` call is hooked in: it computes what PEFT's forward computes for
each row with that row's adapter alone active (``base(x) + B(A(x)) * scaling``: the adapter's product in its
weights' dtype, scaled in float32 and rounded back, added to the base output in the wider of the two dtypes and
rounded to the base output's, as PEFT does), with one product per stack instead of one per adapter. Where padding
the groups to the largest would more than double the rows (one tenant's many rows beside others' few), each
adapter's rows run on their own instead. The stacks are built once per call and set of adapters (the weights do not
change during a ``generate`` call); adapters of other ranks are padded with zeros to the largest.
:meth:`StackedLora.takes` names the layers it computes: plain LoRA (no variant such as DoRA, no bias on B) over a
linear base layer, every adapter of the call that the layer holds in one dtype, in eval mode (dropout off). The
others run PEFT's own mixed-batch forward. It reads weights as they lie on this rank: the caller passes whole
weights only (not ZeRO-3's partitions, which a module call gathers).

This module computes a layer's output; it groups no rows itself (:class:`~llmrl.engine.model.row_adapters.RowGroups`).
"""

from __future__ import annotations

import torch


class StackedLora:
    """A PEFT ``lora.Linear`` layer's ``forward`` over rows of several adapters (see the module's docstring)."""

    same_without_grad = True  # (the written-out decode step calls the layer as a module: this forward runs there)

    def __init__(self, layer, rows):
        self.layer, self.rows = layer, rows
        self._stacks: dict[tuple, tuple] = {}  # adapters -> (A stacked, B stacked, scalings)

    @staticmethod
    def takes(layer, adapters: tuple) -> bool:
        """Whether this module computes ``layer``'s rows for the call's ``adapters``."""
        from peft.tuners.lora import Linear

        held = [name for name in adapters if name in layer.lora_A]
        return (type(layer) is Linear and not layer.training and not layer.merged and not layer.disable_adapters
                and isinstance(layer.get_base_layer(), torch.nn.Linear)
                and not any(name in layer.lora_variant or layer.lora_bias.get(name, False) for name in held)
                and len({layer.lora_A[name].weight.dtype for name in held}) <= 1)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        result = layer.base_layer(x, *args, **kwargs)
        groups = self.rows.groups_of_rows(x.shape[0], x.device)
        stacked = self._stack(groups.adapters)
        if stacked is None:  # no adapter of this pass's rows adapts this layer
            return result
        a, b, scalings = stacked
        count, most = groups.gather.shape
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # rows x positions x features
        positions = flat.shape[1]
        if count * most <= 2 * x.shape[0]:  # padded slots within the rows again: one block, two products
            block = flat.index_select(0, groups.gather.reshape(-1)).to(a.dtype).reshape(count, most * positions, -1)
            delta = _scaled(torch.bmm(torch.bmm(block, a.transpose(1, 2)), b.transpose(1, 2)), scalings)
            delta, rows = delta.reshape(count * most, positions, -1).index_select(0, groups.slots), groups.rows
        else:  # groups of very different sizes (one tenant's many rows beside others' few): adapter by adapter
            parts = [_scaled(flat.index_select(0, members).to(a.dtype) @ a[k].T @ b[k].T, scalings[k])
                     for k, members in enumerate(groups.members)]
            delta, rows = torch.cat(parts), torch.cat(groups.members)
        out = result.reshape(result.shape[0], positions, -1)
        if out.dtype == delta.dtype:
            return out.index_add_(0, rows, delta).reshape(result.shape)
        # PEFT adds the adapter's output to the base output in the wider of their dtypes, then rounds back
        wide = torch.promote_types(out.dtype, delta.dtype)
        summed = out.to(wide).index_add_(0, rows, delta.to(wide))
        return summed.to(result.dtype).reshape(result.shape)

    def _stack(self, adapters: tuple):
        """The layer's A and B of ``adapters`` stacked (zeros for one it does not hold), and their scalings; None
        when it holds none of them."""
        if adapters in self._stacks:
            return self._stacks[adapters]
        layer, stacked = self.layer, None
        held = [name for name in adapters if name in layer.lora_A]
        if held:
            weights = {name: (layer.lora_A[name].weight, layer.lora_B[name].weight) for name in held}
            rank = max(a.shape[0] for a, _ in weights.values())
            some_a, some_b = next(iter(weights.values()))
            a = some_a.new_zeros((len(adapters), rank, some_a.shape[1]))
            b = some_b.new_zeros((len(adapters), some_b.shape[0], rank))
            scalings = torch.zeros((len(adapters), 1, 1), dtype=torch.float32, device=some_a.device)
            for k, name in enumerate(adapters):
                if name in weights:
                    lora_a, lora_b = weights[name]
                    a[k, : lora_a.shape[0]] = lora_a.detach()
                    b[k, :, : lora_b.shape[1]] = lora_b.detach()
                    scalings[k] = layer.scaling[name]
            stacked = (a, b, scalings)
        self._stacks[adapters] = stacked
        return stacked


def _scaled(product: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """``product * scaling`` as PEFT computes ``B(A(x)) * scaling`` (a Python float): in float32 for a product in a
    narrower dtype, rounded back to the product's dtype."""
    return (product * scaling).to(product.dtype)
