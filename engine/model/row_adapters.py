"""Several LoRA adapters in one batched pass (multi-LoRA batching, as S-LoRA and Punica batch the tenants of one
base model): each row of a ``generate`` batch reads the adapter its prompt names.

:class:`RowAdapters` holds one adapter name per prompt of a call. While :meth:`RowAdapters.hooked` is entered, a
forward pre-hook on every PEFT LoRA layer of the model hands the layer PEFT's own ``adapter_names`` argument (one
name per input row), so the layer runs PEFT's mixed-batch forward: the base layer once over every row, then each
adapter's A and B over its own rows. :meth:`RowAdapters.use_batch` names the prompts the next passes are for (a
batch's prompt indices, in the batch's order); a pass of R rows over the batch's P prompts gives row r the adapter of
prompt ``r // (R / P)``, since the rows of one prompt are consecutive: Hugging Face's ``generate`` repeats a prompt's
row for its return sequences and beams with ``repeat_interleave``, and llmrl's decoding loop repeats its cache rows
the same way (:mod:`llmrl.engine.model.decoding.loop`).

The adapters run unmerged in these passes (PEFT's forward: the base product plus each adapter's ``B(A(x)) *
scaling``), so a row's log-probs agree with those of a call for its adapter alone within float32 rounding (such a
call decodes from the adapter merged into the weights where it can: :mod:`llmrl.engine.model.decoding.merged_lora`).
The hook is the only one llmrl's written-out decode step accepts on a layer it calls
(:mod:`llmrl.engine.model.decoding.llama_step`): that step calls the LoRA layer as a module, so the hook runs there
too. Not for weight snapshots of a model without LoRA (one set of swapped-in weights at a time), nor DoRA and the
other LoRA variants (PEFT refuses them in mixed batches), nor a static cache (it pads a batch with rows of no prompt).

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
        self._batch: list[str] = []  # the adapter of each prompt of the batch the passes are for
        self._by_rows: dict[int, list[str]] = {}  # row count -> the adapter of each row (made once per batch)

    def use_batch(self, prompts: list[int] | None) -> None:
        """The next passes are for these prompts of the call (their indices, in the batch's order); None: a
        throw-away batch of one row (lockstep's), which reads the first prompt's adapter."""
        self._batch = [self.names[i] for i in prompts] if prompts is not None else self.names[:1]
        self._by_rows = {}

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
    def hooked(self, model):
        """Every LoRA layer of ``model`` runs its rows on their own adapters while this is entered."""
        from peft.tuners.lora import LoraLayer

        handles = [module.register_forward_pre_hook(self.pass_names, with_kwargs=True)
                   for module in model.modules() if isinstance(module, LoraLayer)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def row_adapters_for(served, adapters) -> tuple[str | None, RowAdapters | None]:
    """A ``generate`` request's ``peft_adapter`` on ``served`` (a :class:`~llmrl.engine.model.served.ServedModel`):
    the adapter to activate for the call, and its :class:`RowAdapters` where its prompts name different ones (else
    None). Raises ValueError for an unknown name, and for a weight snapshot among other adapters."""
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
