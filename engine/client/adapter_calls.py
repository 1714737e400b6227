"""The Caller's calls that change which LoRA adapters an LLM holds: frozen snapshots of an adapter's weights
(``snapshot`` / ``drop_snapshot``) and adapters created while the run goes on (``create_adapter`` /
``delete_adapter``).

:class:`AdapterCalls` is a part of :class:`~llmrl.engine.client.caller.Caller`. The calls check their arguments
and hand them to the ``adapters`` request kind; the servers do the work (:mod:`llmrl.engine.model.snapshots`,
:mod:`llmrl.engine.model.training.new_adapters`). This module keeps no state.
"""

from __future__ import annotations

from llmrl.engine.requests import adapters as kind


class AdapterCalls:
    """``snapshot`` / ``drop_snapshot`` / ``create_adapter`` / ``delete_adapter`` (mixed into Caller)."""

    def _adapters(self, operation: str, name: str, llm: str | None, args: dict) -> dict:
        target = self._open(llm)
        return self._wait(kind.send(self._run, target, kind.AdapterRequest(operation, name, args)))

    def snapshot(self, name: str, *, llm: str | None = None, peft_adapter: str | None = None) -> dict:
        """Freeze the current weights of a LoRA adapter (default: the active one) under ``name``.

        Read the snapshot like an adapter, with ``peft_adapter=name`` in ``generate``, ``score``, ``forward`` and
        ``custom_module_fns``, while the adapter goes on training: the policy that sampled a batch, a reference
        policy, a DPO reference. Several can live at once; taking one under an existing name replaces its weights.
        ``server_memory()`` lists them. Snapshots need ZeRO 0-2 and are saved with ``save`` (and taken again on
        resume). Returns ``{"snapshot", "source", "bytes"}``.
        """
        return self._adapters("snapshot", kind.check_name(name, "snapshot name"), llm,
                              {"source": peft_adapter})

    def drop_snapshot(self, name: str, *, llm: str | None = None) -> dict:
        """Delete a snapshot and free its memory."""
        return self._adapters("drop_snapshot", kind.check_name(name, "snapshot name"), llm, {})

    def create_adapter(self, name: str, *, rank: int = 8, alpha: float | None = None, seed: int = 0,
                       targets=None, llm: str | None = None) -> dict:
        """Add a LoRA adapter to a running LLM, trained with ``forward_backward`` / ``optim_step`` (or ``update``)
        under ``peft_adapter=name``, with an optimizer state of its own, isolated from every other adapter.

        Args:
            rank, alpha: LoRA's r and alpha (default alpha: 2 x rank), dropout 0.
            seed: its initial weights are drawn from this seed, as the ``lora`` initializer draws a config-declared
                adapter's from the config's ``seed``: the same configuration and seed give the same weights.
            targets: ``"attention"``, ``"mlp"``, ``"unembed"`` (the output layer), or module names, alone or in a
                list; default: every linear layer of the transformer blocks (attention and MLP).

        The LLM must already hold a LoRA adapter (the ``lora`` initializer) and be trained with ZeRO 0 in float32.
        Returns ``{"adapter", "parameters"}``.
        """
        args = kind.check_create_args(rank, alpha, seed, targets)
        return self._adapters("create_adapter", kind.check_name(name, "adapter name"), llm, args)

    def delete_adapter(self, name: str, *, llm: str | None = None) -> dict:
        """Delete an adapter made by :meth:`create_adapter`: its weights, optimizer state and cached keys."""
        return self._adapters("delete_adapter", kind.check_name(name, "adapter name"), llm, {})
