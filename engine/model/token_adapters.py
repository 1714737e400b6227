"""Several LoRA adapters in one ``forward`` / ``forward_backward`` pass: each sequence of the call names its adapter,
and every token of a model call runs on its own sequence's adapter, with gradients to that adapter alone.

Training and scoring passes lay sequences out in many ways (a row per context, candidate rows after their context's
keys and values, several contexts packed side by side in one row under a 4-D mask), so adapters are mapped per
token, not per row. Every model call of a pass names the token paths it computes
(:class:`~llmrl.engine.model.reuse.trunk.TrunkRow`: row, columns, and the adapter of the context they belong to);
:meth:`TokenAdapters.model_call` turns them into each adapter's positions in the call's flattened input, and each
LoRA layer (:class:`TokenLora`, the layer's ``forward`` for the pass) runs its base layer over every token, then
each adapter's A and B over that adapter's tokens and adds ``B(A(x)) * scaling`` there, as PEFT's forward computes it
for a token whose adapter alone is active (the product in the adapter's dtype, added in the wider of the two dtypes,
rounded to the base output's). The adapters' own modules are called, so their gradients are the autograd ones and
ZeRO-3 gathers their partitions as in any call.

Every layer calls every adapter of the **whole call** in one order, with no token where this replica's share has
none: the replicas of an LLM then run the same modules in the same order (ZeRO-3 gathers per module call, with the
other replicas), and each adapter of the call gets a gradient on every replica (zero where it had no token).

What it refuses (:meth:`TokenAdapters.hooked`, naming the adapter and layer): LoRA variants such as DoRA, a LoRA
layer that is not a linear layer, merged weights, and PEFT's other per-adapter modules (``modules_to_save`` copies,
trainable tokens), which would need their own per-token routing. A shared pass over a prefix the contexts of several
adapters share is never planned (:mod:`llmrl.engine.model.scoring.planning` gives such a batch none), and a model
call whose token paths cannot be mapped raises rather than running tokens on the wrong weights.

This module routes tokens to adapters; it plans no pass and keeps no gradient bookkeeping
(:mod:`llmrl.engine.model.training.client_steps` does).
"""

from __future__ import annotations

import contextlib

import torch

MIXED = "\x00mixed"  # the adapter of a token path several contexts of different adapters share (never to be run)
ROUTER = "_llmrl_token_adapters"  # the attribute of a hooked model that holds its TokenAdapters (routing_of)


class TokenAdapters:
    """The adapters of one pass, token by token (see the module's docstring)."""

    def __init__(self, adapters: tuple[str, ...]):
        self.adapters = tuple(adapters)
        self._slot = {name: k for k, name in enumerate(self.adapters)}
        # the current model call: token count -> each adapter's flat positions (every token, and the tokens whose
        # logits the call keeps: the output layer's input); None outside a call
        self._positions: dict[int, list[torch.Tensor]] | None = None

    @contextlib.contextmanager
    def model_call(self, rows, shape, device, logits_to_keep=0):
        """Inside, the model call whose input has ``shape`` (rows x columns) and computes the token paths ``rows``
        runs each path's tokens on its adapter (padding and a path of no adapter on the base weights).
        ``logits_to_keep``: the call's (Hugging Face's: the last ``n`` columns, or a boolean mask of the positions
        kept), where the output layer reads those positions only."""
        owner = torch.full(tuple(shape[:2]), -1, dtype=torch.long)
        for row in rows:
            if not len(row.columns) or row.adapter is None:
                continue
            if row.adapter == MIXED:
                raise RuntimeError("a pass over a prefix shared by contexts of different adapters was planned: its "
                                   "tokens would run on one adapter's weights for all of them")
            owner[row.row, torch.as_tensor(list(row.columns), dtype=torch.long)] = self._slot[row.adapter]
        every = owner.reshape(-1)
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dtype == torch.bool:
            kept = owner[logits_to_keep.cpu()]
        elif isinstance(logits_to_keep, int) and 0 < logits_to_keep < owner.shape[1]:
            kept = owner[:, -logits_to_keep:].reshape(-1)
        else:
            kept = every
        # (a count of every position kept is the call's own: the same positions, mapped once)
        flats = {every.numel(): every} if kept.numel() == every.numel() else {kept.numel(): kept, every.numel(): every}
        self._positions = {count: [(flat == k).nonzero().squeeze(1).to(device) for k in range(len(self.adapters))]
                           for count, flat in flats.items()}
        try:
            yield
        finally:
            self._positions = None

    @contextlib.contextmanager
    def throwaway(self):
        """Inside, model calls whose results count for nothing (lockstep padding) run on the base weights, every
        adapter's layers called with no token (the replicas then run the same modules)."""
        self._positions = {}
        try:
            yield
        finally:
            self._positions = None

    def positions(self, tokens: int, device) -> list[torch.Tensor]:
        """Each adapter's positions among a layer input's ``tokens`` flattened positions in the current model call
        (none in a throw-away call)."""
        if self._positions is None:
            raise RuntimeError("a LoRA layer ran outside a model call of a pass mixing adapters: its tokens cannot be "
                               "matched to their adapters; send each adapter's data in a call of its own")
        if not self._positions:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [empty] * len(self.adapters)
        if tokens not in self._positions:
            raise RuntimeError(f"a LoRA layer received {tokens} positions in a model call of {max(self._positions)}: "
                               "its tokens cannot be matched to their adapters; send each adapter's data in a call "
                               "of its own")
        return self._positions[tokens]

    @contextlib.contextmanager
    def hooked(self, model):
        """Every LoRA layer of ``model`` holding an adapter of the call runs its tokens on their own adapters while
        this is entered. Raises ValueError for what it cannot route (see the module's docstring)."""
        from peft.tuners.lora import Linear, LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        layers = []
        for name, module in model.named_modules():
            if isinstance(module, AuxiliaryTrainingWrapper) and _holds(module, self.adapters):
                raise ValueError(f"peft_adapter names several adapters, and {name} holds a per-adapter copy "
                                 f"({type(module).__name__}: modules_to_save or trainable tokens) that one pass "
                                 "cannot route token by token; send each adapter's data in a call of its own")
            if not isinstance(module, LoraLayer):
                continue
            held = [a for a in self.adapters if a in module.lora_A]
            if not held:
                continue
            variant = next((a for a in held if a in getattr(module, "lora_variant", {})), None)
            if type(module) is not Linear or variant is not None or module.merged:
                why = (f"adapter {variant!r} is a LoRA variant (DoRA...)" if variant is not None else
                       "its adapters are merged into its weights" if module.merged else
                       f"it is a {type(module).__name__}, not a LoRA linear layer")
                raise ValueError(f"peft_adapter names several adapters, and layer {name} cannot run them token by "
                                 f"token: {why}; send each adapter's data in a call of its own")
            if "forward" in vars(module):
                raise RuntimeError(f"layer {name}'s forward is already replaced")
            layers.append(module)
        if routing_of(model) is not None:
            raise RuntimeError("the model is already hooked for a pass mixing adapters")
        try:
            for module in layers:
                module.forward = TokenLora(module, self)  # (an instance attribute: removed below)
            vars(model)[ROUTER] = self  # (how the pass's model calls find it: make_caller)
            yield self
        finally:
            vars(model).pop(ROUTER, None)
            for module in layers:
                vars(module).pop("forward", None)


def routing_of(model) -> TokenAdapters | None:
    """The :class:`TokenAdapters` ``model`` is hooked for (None outside a pass mixing adapters)."""
    return vars(model).get(ROUTER)


def _holds(module, adapters) -> bool:
    """Whether PEFT's per-adapter wrapper ``module`` holds a copy for one of ``adapters`` (unknown: it may)."""
    names = getattr(module, "_adapters", None)
    return names is None or bool(set(names) & set(adapters))


class TokenLora:
    """A PEFT ``lora.Linear`` layer's ``forward`` over tokens of several adapters (see the module's docstring)."""

    def __init__(self, layer, tokens: TokenAdapters):
        self.layer, self.tokens = layer, tokens

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        result = layer.base_layer(x, *args, **kwargs)
        flat_x = x.reshape(-1, x.shape[-1])
        out = result.reshape(-1, result.shape[-1])
        positions = self.tokens.positions(flat_x.shape[0], x.device)
        held = [(name, where) for name, where in zip(self.tokens.adapters, positions) if name in layer.lora_A]
        wide = out.dtype
        for name, _ in held:
            wide = torch.promote_types(wide, layer.lora_B[name].weight.dtype)
        if not held:
            return result
        # the tokens grouped by adapter in one gather, and every adapter's output added in one scatter: one copy of
        # the input and of the output (and one each in the backward pass), not one per adapter
        order = torch.cat([where for _, where in held])  # (each token in one adapter's positions at most)
        parts = flat_x.index_select(0, order).split([len(where) for _, where in held])
        deltas = []
        for (name, _), part in zip(held, parts):  # every adapter of the call, in its order, even with no token here
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            part = part.to(lora_a.weight.dtype)
            deltas.append((lora_b(lora_a(layer.lora_dropout[name](part))) * layer.scaling[name]).to(wide))
        summed = out.to(wide).index_add(0, order, torch.cat(deltas))
        return summed.to(result.dtype).reshape(result.shape)
