"""What a served model accumulates between requests: the gradients ``forward_backward`` left for ``optim_step``
(:class:`PendingGradients`), and the adapters and snapshots made while the run serves, with the policy version of
each (:class:`RunTimeAdapters`).

A :class:`~llmrl.engine.model.served.ServedModel` owns one of each (``served.pending``, ``served.run_time``); the
modules that change them are :mod:`llmrl.engine.model.training.client_steps` (pending gradients),
:mod:`llmrl.engine.model.snapshots` and :mod:`llmrl.engine.model.training.new_adapters` (adapters and snapshots made
at run time), and :mod:`llmrl.engine.model.checkpoint` (both saved, and read back on resume).

This module holds the state and answers questions about it; it touches no tensor of the model nor the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PendingGradients:
    """Gradients of ``forward_backward`` calls that wait for ``optim_step``.

    Attributes:
        backwards: the calls whose gradients wait (an update is refused while any do).
        adapters: adapter (None: the model without adapters) -> its calls among them.
        discarded: adapter -> why its pending gradients went with another adapter's failed call (told once, at
            its next call).
        engine_backwards: backward passes DeepSpeed ran since its last step (none: a step of adapters with
            optimizers of their own leaves DeepSpeed's step out, which would find no gradient to finalize).
    """

    backwards: int = 0
    adapters: dict = field(default_factory=dict)
    discarded: dict = field(default_factory=dict)
    engine_backwards: int = 0

    def keep(self, adapters) -> None:
        """Keep the pending calls of ``adapters`` only (the others' gradients were stepped or discarded)."""
        self.adapters = {a: n for a, n in self.adapters.items() if a in adapters}
        self.backwards = sum(self.adapters.values())


@dataclass
class RunTimeAdapters:
    """The adapters and snapshots made while the run serves (a checkpoint saves them and resume makes them again).

    Attributes:
        created: adapters created at run time: name -> how it was made (rank, alpha, seed, targets), in order.
        snapshots: LoRA snapshot name -> the adapter it copies.
        weight_snapshots: snapshot name -> {parameter name: frozen copy} (a model trained without LoRA; under
            ZeRO-3, this rank's flat partition, whose size depends on the replica count).
        versions: adapter or snapshot (None: the model without adapters) -> its policy version, the optimizer steps
            it took (:mod:`llmrl.engine.model.version_counts`; not saved: they start at 0 with the servers).
        optimizers: adapter created at run time -> its own optimizer, where DeepSpeed owns the step (ZeRO 1-3,
            bfloat16: :mod:`llmrl.engine.model.training.own_optimizers`); absent where the engine's torch optimizer
            holds it in a group of its own (ZeRO 0, float32).
        swapped_in: the weight snapshot whose weights are in place now, or None (a read nested in another keeps them).
        steps_without_overflow: float16: the own optimizers' steps without DeepSpeed's since the last overflow
            (:func:`llmrl.engine.model.training.loss_scale.after_own_step` grows the scale after a window of them).
    """

    created: dict = field(default_factory=dict)
    snapshots: dict = field(default_factory=dict)
    weight_snapshots: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    optimizers: dict = field(default_factory=dict)
    swapped_in: str | None = None
    steps_without_overflow: int = 0

    def is_snapshot(self, name) -> bool:
        """Whether ``name`` is a snapshot (frozen: read, never trained)."""
        return name in self.snapshots or name in self.weight_snapshots
