"""Run an updater on one replica: the engine's :class:`~llmrl.plugins.contracts.Trainer` and its safety net.

Every replica of an LLM runs the updater at once on its share of the batch, and their DeepSpeed
collectives must line up. So that a failure on one rank never leaves the others waiting in a
collective, or with different weights, each collective operation of the trainer (forward, backward,
step) first takes a vote on the group's control channel; a rank whose updater raised takes part in the
next vote with "failed", and every rank then stops at the same point, discards gradients accumulated
since the last optimizer step, and reports. Optimizer steps already taken were taken by every replica,
so replicas always hold the same weights.

This module does not pick what to train on; updaters (plugins) do.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from llmrl.engine.errors import PeerAborted, plugin_error
from llmrl.engine.model.forward import prepare, run_forward
from llmrl.engine.model.served import ServedModel
from llmrl.plugins.contracts import ForwardOutputs, Trainer, UpdateBatch


class EngineTrainer(Trainer):
    def __init__(self, served: ServedModel):
        self.served = served
        self.engine = served.engine
        self.llm = served.info
        self.micro_batch_size = served.llm.training.micro_batch_size
        self.gradient_accumulation_steps = served.llm.training.gradient_accumulation_steps
        self.failed_vote_cast = False
        self.optimizer_steps = 0
        self.backward_calls = 0
        self.pending_micro_steps = 0  # micro-steps since the last optimizer step

    def _check_peers(self, ok: bool, where: str) -> None:
        if not self.served.group.all_ok(ok):
            if not ok:
                self.failed_vote_cast = True
                return
            raise PeerAborted(f"another rank of LLM {self.served.llm.name!r} failed; stopped before {where}")

    def forward(self, contexts, candidates=None, heads=(), peft_adapter=None, *, per_token=False, entropy=False,
                add_eos=False, head_kwargs=None) -> ForwardOutputs:
        served = self.served
        empty = len(contexts) == 0
        if empty:  # every replica must make the same calls: run a throw-away row, return nothing of it
            tokenizer = served.tokenizer
            contexts = [tokenizer.decode([tokenizer.pad_token_id]) or "a"]
            candidates = None if candidates is None else [[" a"]]
        try:
            plan, extra = prepare(served, contexts, candidates, heads, peft_adapter, must_agree=True,
                                  per_token=per_token, entropy=entropy, add_eos=add_eos, head_kwargs=head_kwargs)
        except PeerAborted:
            raise
        except Exception:
            self.failed_vote_cast = True
            raise
        out = run_forward(served, plan, extra, trunk_mode="replay")
        return _nothing_of(out) if empty else out

    def backward(self, loss: torch.Tensor) -> None:
        ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad
        self._check_peers(ok, "backward")
        if not ok:
            raise ValueError("trainer.backward needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self.engine.backward(loss, scale_wrt_gas=False)  # batch.mean already weights the samples of the step
        self.backward_calls += 1

    def step(self) -> None:
        self.pending_micro_steps += 1
        if self.pending_micro_steps >= self.gradient_accumulation_steps:
            self.flush()

    def flush(self) -> None:
        """Take the optimizer step if micro-steps are pending (the end of a pass, or of the update)."""
        if self.pending_micro_steps == 0:
            return
        self._check_peers(True, "step")
        self.engine.step()
        self.pending_micro_steps = 0
        self.optimizer_steps += 1

    @property
    def has_adapters(self) -> bool:
        return hasattr(self.served.model, "disable_adapter")

    def sum_across_replicas(self, values) -> torch.Tensor:
        values = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
        self._check_peers(True, "sum_across_replicas")
        return self.served.group.sum_over_replicas(values, self.served.llm.tensor_parallel)

    def adapters_disabled(self):
        model = self.served.model
        if hasattr(model, "disable_adapter"):
            return model.disable_adapter()
        return contextlib.nullcontext()

    def finish(self) -> None:
        self.flush()
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
        self.pending_micro_steps = 0


def _nothing_of(out: ForwardOutputs) -> ForwardOutputs:
    """The outputs of a throw-away pass, with every row removed (gradients still connect to the model)."""
    return out._replace(num_contexts=0,
                        heads={k: _none_of(v) for k, v in out.heads.items()},
                        **{k: _none_of(v) for k, v in out._asdict().items()
                           if k.startswith(("token_", "candidate_", "context_"))})


def _none_of(value):
    """``value`` (None, a tensor or a dict of tensors) with no row."""
    if isinstance(value, dict):
        return {k: v[:0] for k, v in value.items()}
    return None if value is None else value[:0]


def run_update(served: ServedModel, batch: UpdateBatch) -> dict:
    """Run the LLM's updater on this rank's share; returns its stats (plain Python)."""
    if served.updater is None:
        raise ValueError(f"LLM {served.llm.name!r} has no updater; set llms.{served.llm.name}.updater in the config")
    trainer = EngineTrainer(served)
    batch = replace(batch, accumulation_steps=trainer.gradient_accumulation_steps, end_of_pass=trainer.flush)
    name = served.updater_name or type(served.updater).__name__
    try:
        stats = served.updater.update(batch, trainer)
        trainer.finish()
    except PeerAborted:
        trainer.discard_partial_accumulation()
        raise
    except Exception as err:
        if not trainer.failed_vote_cast:
            trainer._check_peers(False, "")
        trainer.discard_partial_accumulation()
        raise plugin_error(f"updater {name!r} failed after {trainer.optimizer_steps} optimizer step(s) "
                           f"(applied on every replica alike): {type(err).__name__}: {err}", name) from err
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
