"""Run an updater on one replica: the engine's :class:`~llmrl.plugins.contracts.Trainer` and its safety net.

Every replica of an LLM runs the updater at once on its share of the batch, and their DeepSpeed
collectives must line up. So that a failure on one rank never leaves the others waiting in a
collective, or with different weights, each collective operation of the trainer (forward, backward,
step) first checks with the group's control channel that every rank is still healthy; a rank whose
updater raised takes part in the next check with "failed", and every rank then stops at the same
point, discards gradients accumulated since the last optimizer step, and reports. Optimizer steps
already taken were taken by every replica, so replicas always hold the same weights.

This module does not pick what to train on; updaters (plugins) do.
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.engine.errors import PluginError
from llmrl.engine.group_sync import all_ok
from llmrl.plugins.contracts import ForwardOutputs, Trainer, UpdateBatch


class PeerAborted(Exception):
    """This rank stopped because another rank of its LLM failed."""


class EngineTrainer(Trainer):
    def __init__(self, runtime):
        self.runtime = runtime
        self.engine = runtime.engine
        self.llm = runtime.info
        self.micro_batch_size = runtime.llm.training.micro_batch_size
        self.gradient_accumulation_steps = runtime.llm.training.gradient_accumulation_steps
        self.group = runtime.control_group
        self.failed_vote_cast = False
        self.optimizer_steps = 0
        self.backward_calls = 0

    def _check_peers(self, ok: bool, where: str) -> None:
        if not all_ok(ok, self.group):
            if not ok:
                self.failed_vote_cast = True
                return
            raise PeerAborted(f"another rank of LLM {self.runtime.llm.name!r} failed; stopped before {where}")

    def forward(self, contexts, candidates=None, heads=(), peft_adapter=None) -> ForwardOutputs:
        runtime = self.runtime
        empty = len(contexts) == 0
        try:
            keys = runtime.check_heads(heads)
            if empty:  # every replica must make the same calls: run a throw-away row, return nothing of it
                contexts = [runtime.tokenizer.decode([runtime.tokenizer.pad_token_id]) or "a"]
                candidates = None if candidates is None else [[" a"]]
            plan_args = (contexts, candidates, keys)
            with runtime.adapter(peft_adapter):
                plan, batches, needs = runtime.plan(*plan_args)
            error = None
        except Exception as err:  # noqa: BLE001 - voted on, then re-raised
            error = err
        self._check_peers(error is None, "forward")
        if error is not None:
            raise error
        with runtime.adapter(peft_adapter):
            out = runtime.forward(plan, batches, needs, keys)
        return _outputs(runtime, out, keys, len(plan.contexts), empty)

    def backward(self, loss: torch.Tensor) -> None:
        ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad
        self._check_peers(ok, "backward")
        if not ok:
            raise ValueError("trainer.backward needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self.engine.backward(loss)
        self.backward_calls += 1

    def step(self) -> None:
        self._check_peers(True, "step")
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        self.optimizer_steps += int(boundary)

    def adapters_disabled(self):
        model = self.runtime.model
        if hasattr(model, "disable_adapter"):
            return model.disable_adapter()
        return contextlib.nullcontext()

    def finish(self) -> None:
        self._check_peers(True, "the end of the update")

    def discard_partial_accumulation(self) -> None:
        """Forget gradients accumulated since the last optimizer step (after an aborted update)."""
        engine = self.engine
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "zero_grad"):
            try:
                optimizer.zero_grad(set_to_none=True)
            except TypeError:
                optimizer.zero_grad()
        for p in engine.module.parameters():
            p.grad = None
        gas = engine.gradient_accumulation_steps()
        engine.micro_steps -= engine.micro_steps % gas


def _outputs(runtime, out: dict, keys, n_contexts: int, empty: bool) -> ForwardOutputs:
    heads = {k: out[f"head:{k}"] for k in keys}
    scores, counts, context_of = out["scores"], out["counts"], out["context_of"]
    if empty:
        scores, counts, context_of = scores[:0], counts[:0], context_of[:0]
        heads = {k: v[:0] for k, v in heads.items()}
        n_contexts = 0
    return ForwardOutputs(kind=runtime.llm.type, num_contexts=n_contexts, candidate_scores=scores,
                          candidate_token_counts=counts, candidate_context=context_of.to(scores.device), heads=heads)


def run_update(runtime, payload: dict):
    """Run the LLM's updater on this rank's share; returns its stats (plain Python)."""
    if runtime.updater is None:
        raise ValueError(f"LLM {runtime.llm.name!r} has no updater; set llms.{runtime.llm.name}.updater in the config")
    batch = UpdateBatch(
        contexts=payload["contexts"], candidates=payload.get("candidates"), kwargs=payload.get("kwargs") or {},
        indices=payload["indices"], global_size=payload["global_size"], replica=runtime.role.replica,
        num_replicas=runtime.llm.replicas, replica_sizes=payload["replica_sizes"],
    )
    trainer = EngineTrainer(runtime)
    name = runtime.updater_name or type(runtime.updater).__name__
    try:
        stats = runtime.updater.update(batch, trainer)
        trainer.finish()
    except PeerAborted:
        trainer.discard_partial_accumulation()
        raise
    except Exception as err:
        if not trainer.failed_vote_cast:
            trainer._check_peers(False, "")
        trainer.discard_partial_accumulation()
        error = PluginError(f"updater {name!r} failed after {trainer.optimizer_steps} optimizer step(s) "
                            f"(applied on every replica alike): {type(err).__name__}: {err}")
        error.plugin = name
        raise error from err
    return {**plain(stats or {}), "optimizer_steps": trainer.optimizer_steps}


def plain(value):
    """Stats as plain Python (tensors become floats or lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
