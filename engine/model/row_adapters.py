"""Several LoRA adapters in one batched pass (multi-LoRA batching, as S-LoRA and Punica batch the tenants of one
base model): each row of a ``generate`` batch reads the adapter its prompt names.

:class:`RowAdapters` holds one adapter name per prompt of a call. While :meth:`RowAdapters.hooked` is entered, every
PEFT LoRA layer of the model runs each row on its own adapter: the base layer once over every row, then the adapters'
A and B over their own rows. :meth:`RowAdapters.use_batch` names the prompts the next passes are for (a batch's
prompt indices, in the batch's order); a pass of R rows over the batch's P prompts gives row r the adapter of prompt
``r // (R / P)``, since the rows of one prompt are consecutive: Hugging Face's ``generate`` repeats a prompt's row
for its return sequences and beams with ``repeat_interleave``, and llmrl's decoding loop repeats its cache rows the
same way (:mod:`llmrl.engine.model.decoding.loop`).

How a layer computes its rows' adapters:
  - plain LoRA (no variant, no bias), every adapter of the layer in one dtype, weights whole on this rank: the
    adapters stacked and applied in two batched products over the rows grouped by adapter
    (:mod:`llmrl.engine.model.stacked_lora`, as Punica's segmented products), the layer's ``forward`` pointed at it
    for the call;
  - a layer split over tensor-parallel ranks: each adapter's rows in the call's order
    (:class:`llmrl.engine.model.tp_lora.OrderedRows`: each rank must sum the same adapter's parts);
  - otherwise PEFT's own mixed-batch forward (its ``adapter_names`` argument, passed by a forward pre-hook), which
    runs each adapter's A and B over its rows one adapter at a time.
PEFT's other per-adapter modules (``modules_to_save`` copies, trainable tokens) take ``adapter_names`` too. Each row
gets its adapter's ``result + B(A(x)) * scaling``, unmerged. In float32 a row's log-probs then agree with those of a
call for its adapter alone within float32 rounding (such a call decodes from the adapter merged into the weights
where it can: :mod:`llmrl.engine.model.decoding.merged_lora`); in a half-precision model, where an adapter's output
is added to the base output in its own dtype alone, PEFT's mixed forward rounds it to the base output's dtype first.
llmrl's written-out decode step (:mod:`llmrl.engine.model.decoding.llama_step`) calls the LoRA layers as modules,
and accepts both. Not for weight snapshots of a model without LoRA (one set of swapped-in weights at a time), nor
DoRA and the other LoRA variants (PEFT refuses them in mixed batches), nor a static cache (it pads a batch with rows
of no prompt), nor ZeRO-3 in lockstep layer by layer (each rank's share would gather other adapters' weights).

This module names adapters per row; it plans no batch and computes no step.
"""

from __future__ import annotations

import contextlib

from llmrl.engine.adapter_names import one_adapter_or_rows


class RowAdapters:
    """The adapter of each prompt of one ``generate`` call, handed to PEFT's LoRA layers row by row.

    Example::

        rows = RowAdapters(["a", "b", "a"])       # prompts 0 and 2 read adapter a, prompt 1 adapter b
        with rows.hooked(model):
            rows.use_batch([2, 1])                # the next passes hold prompt 2's rows, then prompt 1's
            model(input_ids=ids_of_prompts_2_and_1)
    """

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.adapters = tuple(dict.fromkeys(self.names))  # each adapter once, in the order first named
        self._batch: list[str] = []  # the adapter of each prompt of the batch the passes are for
        self._by_rows: dict[int, list[str]] = {}  # row count -> the adapter of each row (made once per batch)
        self._groups: dict[tuple, RowGroups] = {}  # (row count, device) -> the rows grouped by adapter

    def use_batch(self, prompts: list[int] | None) -> None:
        """The next passes are for these prompts of the call (their indices, in the batch's order); None: a
        throw-away batch of one row (lockstep's), which reads the first prompt's adapter."""
        self._batch = [self.names[i] for i in prompts] if prompts is not None else self.names[:1]
        self._by_rows, self._groups = {}, {}

    def groups_of_rows(self, rows: int, device) -> RowGroups:
        """The current batch's ``rows`` rows grouped by adapter (:class:`RowGroups`, made once per batch)."""
        key = (rows, str(device))
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = RowGroups.of(self.names_of_rows(rows), self.adapters, device)
        return groups

    def names_of_rows(self, rows: int) -> list[str]:
        """The adapter of each of ``rows`` rows of the current batch."""
        names = self._by_rows.get(rows)
        if names is None:
            prompts = len(self._batch)
            if not prompts or rows % prompts:
                raise RuntimeError(f"a pass of {rows} rows over a batch of {prompts} prompts: the rows of each "
                                   "prompt must be consecutive and equal in number")
            each = rows // prompts
            names = self._by_rows[rows] = [name for name in self._batch for _ in range(each)]
        return names

    def pass_names(self, module, args, kwargs):
        """The forward pre-hook: PEFT's ``adapter_names`` for this pass's rows."""
        return args, {**kwargs, "adapter_names": self.names_of_rows(len(args[0]))}

    @contextlib.contextmanager
    def hooked(self, model, whole: bool = True):
        """Every LoRA layer of ``model`` runs its rows on their own adapters while this is entered. ``whole``: the
        adapters' weights are whole on this rank (not ZeRO-3 partitions that each module call gathers), so layers
        of plain LoRA stack them (:mod:`llmrl.engine.model.stacked_lora`)."""
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        from llmrl.engine.model.stacked_lora import StackedLora
        from llmrl.engine.model.tp_lora import OrderedRows, is_split

        handles, stacked = [], []
        try:
            for module in model.modules():
                if isinstance(module, AuxiliaryTrainingWrapper):  # modules_to_save, trainable tokens: PEFT's own
                    handles.append(module.register_forward_pre_hook(self.pass_names, with_kwargs=True))
                if not isinstance(module, LoraLayer):
                    continue
                if whole and "forward" not in vars(module) and StackedLora.takes(module, self.adapters):
                    module.forward = StackedLora(module, self)  # (an instance attribute: removed below)
                    stacked.append(module)
                elif "forward" not in vars(module) and is_split(module):  # tensor parallelism: in the call's order
                    module.forward = OrderedRows(module, self)
                    stacked.append(module)
                else:
                    handles.append(module.register_forward_pre_hook(self.pass_names, with_kwargs=True))
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for module in stacked:
                del module.forward


class RowGroups:
    """A pass's rows grouped by adapter, padded to the largest group: ``adapters`` (those with rows in the pass, in
    the call's order), ``gather`` (adapters x most rows: the row each slot reads; a padding slot reads row 0),
    ``slots`` (the slots of real rows, flat), ``rows`` (the row each of those slots is) and ``members`` (each
    adapter's rows)."""

    def __init__(self, gather, slots, rows, adapters: tuple, members: list):
        self.gather, self.slots, self.rows, self.adapters = gather, slots, rows, adapters
        self.members = members  # each adapter's rows, unpadded

    @classmethod
    def of(cls, names: list[str], adapters: tuple, device) -> RowGroups:
        import torch

        members = {name: [r for r, n in enumerate(names) if n == name] for name in adapters}
        members = {name: rows for name, rows in members.items() if rows}
        adapters = tuple(members)
        most = max(len(rows) for rows in members.values())
        gather = torch.zeros((len(adapters), most), dtype=torch.long)
        slots, rows = [], []
        for k, name in enumerate(adapters):
            for j, row in enumerate(members[name]):
                gather[k, j] = row
                slots.append(k * most + j)
                rows.append(row)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(gather.to(device), as_tensor(slots), as_tensor(rows), adapters,
                   [as_tensor(members[name]) for name in adapters])


def row_adapters_for(served, adapters, contexts: int) -> tuple[str | None, RowAdapters | None]:
    """A ``generate`` request's ``peft_adapter`` on ``served`` (a :class:`~llmrl.engine.model.served.ServedModel`)
    for ``contexts`` prompts: the adapter to activate for the call, and its :class:`RowAdapters` where its prompts
    name different ones (else None). Raises ValueError for a list of another length, an unknown name, and a weight
    snapshot among other adapters."""
    if isinstance(adapters, list) and len(adapters) != contexts:
        raise ValueError(f"peft_adapter lists {len(adapters)} adapter name(s) for {contexts} context(s)")
    adapters = one_adapter_or_rows(adapters)
    if not isinstance(adapters, list):
        return adapters, None
    for name in adapters:
        served.check_adapter(name)
        if name in served.run_time.weight_snapshots:
            raise ValueError(f"peft_adapter names weight snapshot {name!r} among other adapters: a weight snapshot "
                             "(of a model without LoRA) swaps in a whole set of weights for a call; generate its "
                             "prompts in a call of their own")
    return None, RowAdapters(adapters)
