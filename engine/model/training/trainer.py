"""Run an updater on one replica: the engine's :class:`~llmrl.plugins.contracts.Trainer` and its safety net.

Every replica of an LLM runs the updater at once on its share of the batch, and their DeepSpeed
collectives must line up. So that a failure on one rank never leaves the others waiting in a
collective, or with different weights, each collective operation of the trainer (forward, backward,
step) first takes a vote on the group's control channel; a rank whose updater raised takes part in the
next vote with "failed", and every rank then stops at the same point, discards gradients accumulated
since the last optimizer step, and reports. Optimizer steps already taken were taken by every replica,
so replicas always hold the same weights.

Each vote also carries the trainer calls the rank has made so far: replicas whose updaters parted (one calls
``backward`` once per local sample, and the shares are uneven) all raise :class:`ReplicasOutOfStep` at the
first vote where they differ, naming each replica's counts, instead of waiting in a collective until the
timeout. A non-finite loss (voted before ``backward``) or gradient (voted before the step; DeepSpeed's own norm
check under ZeRO 1-3) skips the optimizer step on every replica, and a step that leaves a non-finite weight or
moment is undone (voted after it, :mod:`llmrl.engine.model.training.finite_steps`); each raises
:class:`NonFiniteUpdate` naming the step and the statistic. A step touches only the adapters whose passes had
gradients since the last step (see :mod:`llmrl.engine.model.training.optimizer`). ``loss.backward()`` on the
trainer's outputs raises at once with the fix (``trainer.backward``).

A training forward longer than ``training.max_tokens_per_micro_batch`` tokens is run without gradients, and its
backward is replayed in passes within that budget (:mod:`llmrl.engine.model.training.passes`); the replicas decide
together, so that their backward passes run the same modules.

The votes are :mod:`llmrl.engine.model.training.replica_votes` (the calls counted, and every vote taken), the
deferred backward :mod:`llmrl.engine.model.training.deferred_backward`: two parts the trainer composes and drives.
This module does not pick what to train on; updaters (plugins) do.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from llmrl.engine.adapter_names import ContextAdapters
from llmrl.engine.errors import PeerAborted, plugin_error
from llmrl.engine.model.cpu_matmul import frozen_linears
from llmrl.engine.model.forward import plan_and_agree
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.training import guards
from llmrl.engine.model.training.deferred_backward import DeferredBackward, adapters_off, throwaway_inputs
from llmrl.engine.model.training.finite_steps import NonFiniteUpdate, copied_step, keep_finite
from llmrl.engine.model.training.guards import first_non_finite_gradient, guarded, nothing_of, plain_stats
from llmrl.engine.model.training.loss_scale import after_own_step, loss_scale
from llmrl.engine.model.training.model_access import ModelAccess
from llmrl.engine.model.training.own_optimizers import drop_own, engine_step, reduce_own, step_own, steps_alone
from llmrl.engine.model.training.passes import refuse_too_long
from llmrl.engine.model.training.replica_votes import (
    BACKWARD,
    END,
    FORWARD,
    STEP,
    SUM,
    ReplicasOutOfStep,
    ReplicaVotes,
)
from llmrl.engine.model.zero3_gather import clear_zero3_gradients
from llmrl.engine.server.group import OutOfStep
from llmrl.plugins.contracts import ForwardOutputs, Trainer, UpdateBatch
from llmrl.plugins.per_sample import slicing_note


class EngineTrainer(ModelAccess, Trainer):
    """The :class:`~llmrl.plugins.contracts.Trainer` an updater drives on one rank: the contract's calls, the
    optimizer steps and the bookkeeping between them. Two parts of its own do the rest: :attr:`votes`
    (:class:`~llmrl.engine.model.training.replica_votes.ReplicaVotes`: the calls counted and voted on with the
    other ranks) and :attr:`deferred` (:class:`~llmrl.engine.model.training.deferred_backward.DeferredBackward`:
    forward passes within the token budget, and the backward of those deferred)."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.engine = served.engine
        self.llm = served.info
        self.micro_batch_size = served.llm.training.micro_batch_size
        self.gradient_accumulation_steps = served.llm.training.gradient_accumulation_steps
        self.optimizer_steps = 0
        self.pending_micro_steps = self.backwards_since_step = 0  # micro-steps, backward calls since the last step
        self.last_lr: float | None = None  # the learning rate of the last optimizer step
        self.trained_adapters: set[str] = set()  # adapters of the passes with gradients since the last step
        self.without_adapters = False  # inside adapters_disabled()
        self.inside_backward = False
        self.last_forward_empty = False
        self.votes = ReplicaVotes(served.group, served.llm)
        max_tokens = served.llm.training.max_tokens_per_micro_batch or served.llm.token_budget
        self.deferred = DeferredBackward(served, self.votes, max_tokens)

    @property
    def failed_vote_cast(self) -> bool:
        """Whether this rank has cast its last vote (its failure told, or every rank raising alike)."""
        return self.votes.failed_vote_cast

    @failed_vote_cast.setter
    def failed_vote_cast(self, value: bool) -> None:  # finite_steps.keep_finite sets it
        self.votes.failed_vote_cast = value

    def forward(self, contexts, candidates=None, heads=(), peft_adapter=None, *, per_token=False, entropy=False,
                add_eos=False, head_kwargs=None, logits=False, logprobs=True) -> ForwardOutputs:
        served, votes = self.served, self.votes
        mixed = isinstance(peft_adapter, ContextAdapters)  # each context names its own adapter
        for name in peft_adapter.call if mixed else [peft_adapter]:
            if torch.is_grad_enabled() and served.run_time.is_snapshot(name):
                raise ValueError(f"{name!r} is a snapshot (frozen): train its source, or read the snapshot "
                                 "without gradients")
        empty = self.last_forward_empty = len(contexts) == 0
        if empty:  # every replica must make the same calls: run a throw-away row, return nothing of it
            contexts, candidates = throwaway_inputs(served.tokenizer, candidates is not None)
            if mixed:
                peft_adapter = ContextAdapters([None] * len(contexts), peft_adapter.call)
        try:
            plan, extra = plan_and_agree(served, contexts, candidates, heads, peft_adapter, must_agree=True,
                                         per_token=per_token, entropy=entropy, add_eos=add_eos, logits=logits,
                                         logprobs=logprobs, head_kwargs=head_kwargs,
                                         position=votes.position(FORWARD))
        except OutOfStep as err:
            raise votes.out_of_step(err) from None
        except PeerAborted:
            raise
        except Exception:
            votes.failed_vote_cast = True
            raise
        votes.calls[FORWARD] += 1
        out = self.deferred.forward(plan, extra, self.without_adapters)
        if torch.is_grad_enabled():
            if not self.without_adapters and served.adapters:
                self.trained_adapters.update(peft_adapter.call if mixed else [peft_adapter or served.active_adapter()])
            out = guarded(out, self._check_inside_backward)
        return nothing_of(out) if empty else out

    def scored_token_counts(self, contexts, candidates, add_eos: bool = False) -> torch.Tensor:
        from llmrl.engine.model.forward import scored_token_counts
        return scored_token_counts(self.served, contexts, candidates, add_eos)

    def _check_inside_backward(self) -> None:
        if not self.inside_backward:
            raise DirectBackward("call trainer.backward(loss), not loss.backward(): the DeepSpeed engine must run "
                                 "the backward pass (it averages gradients over the replicas and keeps them in step)")

    def backward(self, loss: torch.Tensor) -> None:
        ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad
        finite = not ok or bool(torch.isfinite(loss.detach()))
        everyone_ok, bad_replica = self.votes.vote(ok, BACKWARD, 0 if finite else self.served.role.replica + 1)
        self.votes.calls[BACKWARD] += 1
        if not everyone_ok:
            if not ok:
                self.votes.failed_vote_cast = True
                raise ValueError("trainer.backward needs a scalar loss tensor that requires grad, got "
                                 f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            raise PeerAborted(f"another rank of LLM {self.served.llm.name!r} failed; stopped before its backward")
        if bad_replica:
            self.votes.failed_vote_cast = True  # every rank raises here
            value = f" ({float(loss.detach())})" if not finite else ""
            raise NonFiniteUpdate(f"the loss of backward call {self.votes.calls[BACKWARD]} was not finite on replica "
                                  f"{bad_replica - 1}{value}: optimizer step {self.optimizer_steps + 1} was skipped "
                                  f"on every replica; {self.optimizer_steps} step(s) of this update were taken")
        self.inside_backward, self.backwards_since_step = True, self.backwards_since_step + 1
        try:  # batch.mean already weights the samples of the step (scale_wrt_gas=False)
            self.deferred.backward(loss)
        finally:
            self.inside_backward = False
            self.deferred.clear()

    def step(self) -> None:
        self.votes.calls[STEP] += 1
        self.pending_micro_steps += 1
        if self.pending_micro_steps >= self.gradient_accumulation_steps:
            self.flush()

    def flush(self) -> set:
        """Take the optimizer step if micro-steps are pending (the end of a pass, or of the update). Replicas
        first agree that every gradient they hold is finite; otherwise none steps. In float16 a gradient that is not
        finite is a loss-scale overflow instead: the step of the weights it is in is skipped and the scale lowered
        (by DeepSpeed for its parameters, :mod:`llmrl.engine.model.training.loss_scale` for the others); the
        adapters skipped are returned (None: the weights DeepSpeed steps)."""
        if self.pending_micro_steps == 0:
            return set()
        float16 = self.engine.fp16_enabled()
        bad = None if float16 else first_non_finite_gradient(self.engine.module)
        everyone_ok, bad_replica = self.votes.vote(True, STEP, 0 if bad is None else self.served.role.replica + 1)
        self.votes.stop_unless(everyone_ok, None)  # a peer failed before its step: none steps (its collectives wait)
        if bad_replica:
            self.votes.failed_vote_cast = True
            where = f" ({bad})" if bad is not None else ""
            raise NonFiniteUpdate(f"a gradient was not finite on replica {bad_replica - 1}{where}: optimizer step "
                                  f"{self.optimizer_steps + 1} was skipped on every replica; "
                                  f"{self.optimizer_steps} step(s) of this update were taken")
        steps = self.served.adapter_steps
        self.last_lr = float(self.engine.optimizer.param_groups[0]["lr"])  # the rate this step takes (lr_schedule)
        with steps.only(self.trained_adapters) if steps is not None else contextlib.nullcontext(), \
                copied_step(self.served, self.trained_adapters) as copy:
            own, overflowed = reduce_own(self.served, self.trained_adapters,  # before DeepSpeed's step may clear
                                         loss_scale(self.engine))               # gradients
            alone = steps_alone(self.served, own)
            applied = engine_step(self.served, own)
            if own and applied:
                step_own(self.served, [name for name in own if name not in overflowed], copy.stepped)
            elif own:  # DeepSpeed skipped the step: so do the adapters stepping with it
                drop_own(self.served, own)
            if alone or (overflowed and applied):  # float16: DeepSpeed saw neither these steps nor this overflow
                after_own_step(self.engine, self.served.run_time, bool(overflowed))
        clear_zero3_gradients(self.engine)
        trained, self.trained_adapters = self.trained_adapters, set()
        self.pending_micro_steps = self.backwards_since_step = 0
        skipped = set(overflowed) if applied else set(trained) or {None}  # (None: a model without adapters)
        if float16 and (not applied or (skipped and skipped >= trained)):  # an overflow skipped it all
            return skipped
        copy = replace(copy, trained=copy.trained - skipped)
        if not applied:  # DeepSpeed found the gradient norm not finite (ZeRO 1-3)
            self.votes.failed_vote_cast = True  # the norm is reduced over the replicas: every rank is here
            raise NonFiniteUpdate(f"the gradient norm of optimizer step {self.optimizer_steps + 1} was not finite: "
                                  f"DeepSpeed skipped the step on every replica; {self.optimizer_steps} step(s) of "
                                  "this update were taken")
        keep_finite(self, copy, lambda bad: self.votes.agree(STEP, bad))  # undone on every replica, or kept by all
        self.optimizer_steps += 1
        return skipped

    @property
    def has_adapters(self) -> bool:
        return hasattr(self.served.model, "disable_adapter")

    def sum_across_replicas(self, values) -> torch.Tensor:
        values = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
        self.votes.check_peers(True, SUM)
        self.votes.calls[SUM] += 1
        return self.served.group.sum_over_replicas(values, self.served.llm.tensor_parallel)

    @contextlib.contextmanager
    def adapters_disabled(self):
        model = self.served.model
        previous = self.without_adapters
        self.without_adapters = True
        try:
            with adapters_off(model):
                yield
        finally:
            self.without_adapters = previous

    def finish(self) -> None:
        self.flush()
        if self.backwards_since_step:  # every replica runs the same calls: each raises here alike
            raise ValueError(f"the updater called trainer.backward {self.backwards_since_step} time(s) after its last "
                             "trainer.step(): call trainer.step() after each minibatch's backward (those gradients, "
                             "never applied, were discarded: the next update would have added them to its own)")
        self.votes.check_peers(True, END)

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
        for own in self.served.run_time.optimizers.values():
            own.zero_grad()
        clear_zero3_gradients(engine)
        self.pending_micro_steps = self.backwards_since_step = 0
        self.trained_adapters = set()
        self.deferred.clear()


class DirectBackward(RuntimeError):
    """``loss.backward()`` was called on the trainer's outputs instead of ``trainer.backward(loss)``."""


def run_update(served: ServedModel, batch: UpdateBatch) -> dict:
    """Run the LLM's updater on this rank's share; returns its stats (plain Python)."""
    if served.pending.backwards:
        raise ValueError(f"LLM {served.llm.name!r} holds the gradients of {served.pending.backwards} forward_backward "
                         "call(s) not yet applied: call optim_step() before update() (the update's step would apply "
                         "them too)")
    if served.updater is None:
        raise ValueError(f"LLM {served.llm.name!r} has no updater; set llms.{served.llm.name}.updater in the config")
    trainer = EngineTrainer(served)
    batch = replace(batch, accumulation_steps=trainer.gradient_accumulation_steps, end_of_pass=trainer.flush)
    name = served.updater_name or type(served.updater).__name__
    try:
        refuse_too_long(served, batch)
        with frozen_linears(served.module), guards.distribution_checks():  # forward, backward, recomputed passes
            stats = served.updater.update(batch, trainer)
        trainer.finish()
    except PeerAborted:
        trainer.discard_partial_accumulation()
        raise
    except BaseException as err:  # sys.exit() in an updater too: the peers are told, the rank serves on
        if not trainer.failed_vote_cast:
            trainer.votes.check_peers(False, END)
        trainer.discard_partial_accumulation()
        hint = ""
        if trainer.last_forward_empty and not isinstance(err, (NonFiniteUpdate, ReplicasOutOfStep)):
            hint = (f" (replica {batch.replica}'s last minibatch was empty: the replicas' shares are "
                    f"{batch.replica_sizes}, and every replica runs every minibatch, so trainer.forward returned "
                    "outputs with no row; code such as torch.distributions.Categorical refuses those: skip it when "
                    "len(minibatch) == 0 and still call trainer.backward(minibatch.mean(...)), which is 0 there)")
        if getattr(served.updater, "per_sample_args", None) is None and not isinstance(err, ReplicasOutOfStep):
            keys = batch.per_sample_keys
            hint += slicing_note(batch.kwargs, list(keys) if keys is not None else None)
        raise plugin_error(f"updater {name!r} failed after {trainer.optimizer_steps} optimizer step(s) "
                           f"(applied on every replica alike): {type(err).__name__}: {err}{hint}", name) from err
    return {**plain_stats(stats or {}), "optimizer_steps": trainer.optimizer_steps, "lr": trainer.last_lr,
            "passes_with_gradients": trainer.deferred.passes_with_gradients}

