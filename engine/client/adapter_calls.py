"""The Caller's calls that change which LoRA adapters an LLM holds: frozen snapshots of an adapter's weights
(``snapshot`` / ``drop_snapshot``), adapters created while the run goes on (``create_adapter`` /
``delete_adapter``), and one adapter's state saved to a folder and loaded back (``save_adapter`` /
``load_adapter``).

:class:`AdapterCalls` is a part of :class:`~llmrl.engine.client.caller.Caller`, given the Caller's shared
:class:`~llmrl.engine.client.call_context.CallContext`. The calls check their arguments and hand each to its own
request kind (:mod:`llmrl.engine.requests.adapters`); the servers do the work (:mod:`llmrl.engine.model.snapshots`,
:mod:`llmrl.engine.model.training.new_adapters`). This module keeps no state.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests import adapters as kind
from llmrl.engine.requests.adapters import create_adapter as create_kind
from llmrl.engine.requests.adapters import delete_adapter as delete_kind
from llmrl.engine.requests.adapters import drop_snapshot as drop_kind
from llmrl.engine.requests.adapters import load_adapter as load_kind
from llmrl.engine.requests.adapters import save_adapter as save_kind
from llmrl.engine.requests.adapters import snapshot as snapshot_kind

if TYPE_CHECKING:
    from llmrl.engine.client.call_context import CallContext


class AdapterCalls:
    """``snapshot`` / ``drop_snapshot`` / ``create_adapter`` / ``delete_adapter`` / ``save_adapter`` /
    ``load_adapter``.

    Args:
        context: the Caller's shared run and wait.
    """

    def __init__(self, context: CallContext):
        self._context: CallContext = context

    def _adapters(self, send, llm: str | None, request) -> dict:
        target = self._context.open(llm)
        return self._context.wait(send(self._context.run, target, request))

    def snapshot(self, name: str, *, llm: str | None = None, peft_adapter: str | None = None) -> dict:
        """Freeze the current weights of a LoRA adapter (default: the active one) under ``name``.

        Read the snapshot like an adapter, with ``peft_adapter=name`` in ``generate``, ``score``, ``forward`` and
        ``custom_module_fns``, while the adapter goes on training: the policy that sampled a batch, a reference
        policy, a DPO reference. Several can live at once; taking one under an existing name replaces its weights.
        ``server_memory()`` lists them. Under ZeRO-3 a LoRA snapshot is whole on every rank, and a
        snapshot of a model without LoRA holds each rank's partitions. Snapshots are saved with ``save`` (and taken
        again on resume). Returns ``{"snapshot", "source", "bytes"}``.
        """
        name = kind.check_new_name(name, "snapshot name")
        return self._adapters(snapshot_kind.send, llm, snapshot_kind.SnapshotRequest(name, peft_adapter))

    def drop_snapshot(self, name: str, *, llm: str | None = None) -> dict:
        """Delete a snapshot and free its memory."""
        name = kind.check_name(name, "snapshot name")
        return self._adapters(drop_kind.send, llm, drop_kind.DropSnapshotRequest(name))

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

        The LLM must already hold a LoRA adapter (the ``lora`` initializer) and be trained with ZeRO 0, 1, 2 or 3, in
        float32 or bfloat16 (under ZeRO 1-3 or bfloat16 the adapter steps with an optimizer of its own: float32
        masters, gradients averaged over the replicas and clipped by its own norm).
        Returns ``{"adapter", "parameters"}``.
        """
        args = kind.check_create_args(rank, alpha, seed, targets)
        name = kind.check_new_name(name, "adapter name")
        return self._adapters(create_kind.send, llm, create_kind.CreateAdapterRequest(name, **args))

    def delete_adapter(self, name: str, *, llm: str | None = None) -> dict:
        """Delete an adapter made by :meth:`create_adapter`: its weights, optimizer state and cached keys."""
        name = kind.check_name(name, "adapter name")
        return self._adapters(delete_kind.send, llm, delete_kind.DeleteAdapterRequest(name))

    def save_adapter(self, path: str | os.PathLike, *, peft_adapter: str | None = None, llm: str | None = None
                     ) -> dict:
        """Save one LoRA adapter's state (default: the active adapter) in a new folder ``path``: its weights, how
        to make it again and, on a trained LLM, its optimizer state (Adam moments and step counts), plus a
        ``peft`` folder plain PEFT loads.

        Unlike :meth:`save`, which checkpoints the whole run, this saves one adapter, to load into a new adapter
        of this run or of another (:meth:`load_adapter`). ``path`` must not exist (nothing is overwritten) and
        must be readable by every server rank that will load it. Needs no pending
        ``forward_backward`` gradients on the adapter; on a trained LLM under ZeRO 1-3 or bfloat16, an adapter
        created at run time. Returns ``{"adapter", "path", "parameters", "optimizer_state"}``.
        """
        folder = os.path.abspath(os.fspath(path))
        if os.path.exists(folder):
            raise InvalidArgument(f"{folder} exists; save_adapter writes a new folder and overwrites nothing: pick "
                                  "another path")
        name = kind.check_name(peft_adapter, "peft_adapter") if peft_adapter is not None else None
        return self._adapters(save_kind.send, llm, save_kind.SaveAdapterRequest(name, folder))  # None: the active one

    def load_adapter(self, path: str | os.PathLike, name: str, *, optimizer: bool = True,
                     llm: str | None = None) -> dict:
        """Load a state written by :meth:`save_adapter` into adapter ``name``: a new adapter is created with the
        saved rank, alpha and targets (an existing one of the same shapes is overwritten in place). With
        ``optimizer=True`` its Adam moments and step counts are the saved ones, else fresh. Needs ZeRO 0 in
        float32 on a trained LLM, and no pending gradients on ``name``. Returns ``{"adapter", "path", "created",
        "optimizer_state", "rank"}``. A damaged or crafted state (a weight or moment of another shape or dtype, not
        finite, a step count below 1) is refused naming the field, and nothing changes.
        """
        folder = os.path.abspath(os.fspath(path))
        if not os.path.isdir(folder):
            raise InvalidArgument(f"{folder} is not a folder saved by save_adapter")
        if not isinstance(optimizer, bool):
            raise InvalidArgumentType(f"optimizer must be True or False, got {optimizer!r}")
        name = kind.check_name(name, "adapter name")
        return self._adapters(load_kind.send, llm, load_kind.LoadAdapterRequest(name, folder, optimizer))
