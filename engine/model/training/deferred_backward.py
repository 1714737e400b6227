"""The trainer's part that runs its forward passes within ``training.max_tokens_per_micro_batch`` tokens: a training
forward longer than that runs without gradients, and its backward is replayed later in passes within the budget.

The replicas decide together whether a forward is deferred (so that their backward passes run the same modules),
agree on the number of passes of each deferred forward (a replica with fewer runs throw-away passes), and vote
before and after each pass, so that a rank that fails in a pass (out of memory, say) stops every rank before the
backward's collectives. How a forward is cut into passes, and why the sum of their backward passes is the gradient
of the loss, is :mod:`llmrl.engine.model.training.passes`.

This module does not count the updater's calls nor check losses and gradients (the trainer,
:mod:`llmrl.engine.model.training.trainer`, does), and it takes no optimizer step.
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.engine.adapter_names import ContextAdapters
from llmrl.engine.graph import graph_zero
from llmrl.engine.model.forward import ForwardPlan, plan_forward, plan_part, run_forward
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.training.loss_scale import backward_factor
from llmrl.engine.model.training.passes import (
    DeferredForward,
    form_passes,
    leaf_outputs,
    micro_batch_tokens,
    pass_surrogate,
    sub_plan,
)
from llmrl.engine.model.training.replica_votes import BACKWARD, FORWARD, ReplicaVotes
from llmrl.engine.model.zero3_gather import gathered_weights
from llmrl.plugins.contracts import ForwardOutputs


def throwaway_inputs(tokenizer, with_candidates: bool) -> tuple[list[str], list[list[str]] | None]:
    """One row that a replica with nothing to run runs anyway (every replica must make the same model calls)."""
    return [tokenizer.decode([tokenizer.pad_token_id]) or "a"], [[" a"]] if with_candidates else None


def adapters_off(model):
    """Inside, the model runs without its LoRA adapters (a model without adapters runs as it is)."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


class DeferredBackward:
    """The forward passes of one trainer, and the backward of those it deferred.

    Args:
        served: the rank's served model (what the passes run).
        votes: the trainer's votes with the other ranks (each decision here is one of them).
        max_tokens: the most tokens a pass with gradients holds.

    Use: :meth:`forward` for every planned forward of the trainer, :meth:`backward` for every loss, :meth:`clear`
    after an aborted update. :attr:`passes_with_gradients` counts the forward passes whose activations a backward
    pass read.
    """

    def __init__(self, served: ServedModel, votes: ReplicaVotes, max_tokens: int):
        self.served = served
        self.votes = votes
        self.max_tokens = max_tokens
        self.forwards: list[DeferredForward] = []  # forwards since the last backward, to replay in passes
        self.passes_with_gradients = 0

    def forward(self, plan: ForwardPlan, extra: int, without_adapters: bool) -> ForwardOutputs:
        """Run a planned forward: deferred when gradients are on and the replicas agree that one of them is too
        long (never with ``head_kwargs``: they are the whole call's, and a pass holds only some of its rows).
        ``without_adapters``: it runs inside the trainer's ``adapters_disabled`` (its passes will too)."""
        split = False
        if torch.is_grad_enabled():  # replicas split together: their backward passes must run the same modules
            too_long = micro_batch_tokens(plan.plan) > self.max_tokens and not plan.head_kwargs
            split = bool(self.votes.agree(FORWARD, int(too_long)))
        if split:
            return self._defer(plan, extra, without_adapters)
        # a gradient-free pass under ZeRO-3 gathers the weights once (every replica makes the same passes)
        served = self.served
        with served.adapter(plan.adapter), contextlib.nullcontext() if torch.is_grad_enabled() else gathered_weights(
                served.engine, served.llm.training.zero3_gather_mb):  # a weight snapshot in place before the gather
            out = run_forward(served, plan, extra, trunk_mode="replay", update_pass=True)
        self.passes_with_gradients += int(torch.is_grad_enabled())
        return out

    def _defer(self, plan: ForwardPlan, extra: int, without_adapters: bool) -> ForwardOutputs:
        """A forward pass longer than ``max_tokens``: run without gradients now, its backward replayed in passes."""
        with torch.no_grad():
            out = run_forward(self.served, plan, extra, trunk_mode="replay", update_pass=True)
        out, leaves = leaf_outputs(out, spent := [])
        self.forwards.append(DeferredForward(plan.plan, form_passes(plan.plan, self.max_tokens), leaves,
                                             out.candidate_token_counts.tolist(), plan, without_adapters, spent))
        return out

    def clear(self) -> None:
        """Forget the deferred forwards (after a backward, or an aborted one)."""
        self.forwards = []

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``: its own graph, and the passes of the deferred forwards it reads. Every replica
        deferred the same forwards (they vote); for each, they agree on the number of passes, and one with fewer
        runs throw-away passes with that forward's heads and adapter."""
        deferred, self.forwards = self.forwards, []
        engine = self.served.engine
        self.served.pending.engine_backwards += 1
        factor = backward_factor(engine)  # (float16 at ZeRO 0: the loss scale, which DeepSpeed leaves to us there)
        if not deferred:
            engine.backward(loss * factor if factor != 1.0 else loss, scale_wrt_gas=False)
            return
        grads = torch.autograd.grad(loss, [leaf for d in deferred for _, _, leaf in d.leaves], retain_graph=True,
                                    allow_unused=True)
        pending, first = loss, 0  # the loss's own graph goes back with the first pass
        for d in deferred:
            mine, first = grads[first:first + len(d.leaves)], first + len(d.leaves)
            count, done = self.votes.agree(BACKWARD, len(d.passes)), set()
            for k in range(count):
                part = self._replay_pass(d, k if k < len(d.passes) else None, mine, done)
                part = part if pending is None else pending + part
                engine.backward(part * factor if factor != 1.0 else part, scale_wrt_gas=False)
                pending = None
            self.passes_with_gradients += count
            d.spent.append(True)

    def _replay_pass(self, deferred: DeferredForward, k: int | None, grads, contexts_done: set[int]) -> torch.Tensor:
        """Pass ``k`` of a deferred forward (None: a throw-away pass) with gradients, and its share of the loss.
        Replicas vote before it (its model calls) and after it (whether it succeeded), so that a rank that fails,
        out of memory for one, stops every rank before the backward's collectives."""
        whole, plan, error = deferred.forward_plan, None, None
        try:
            if k is None:
                contexts, candidates = throwaway_inputs(self.served.tokenizer,
                                                        any(c.candidates for c in deferred.plan.contexts))
                adapter = whole.adapter if whole.mixed is None else ContextAdapters([None] * len(contexts),
                                                                                     whole.mixed)
                plan = plan_forward(self.served, contexts, candidates, whole.heads, adapter,
                                    per_token=whole.needs.per_token)
            else:
                plan = plan_part(self.served, whole, sub_plan(deferred.plan, deferred.passes[k]))
        except Exception as err:  # noqa: BLE001 - voted on, then raised
            error = err
        calls = plan.model_calls if plan is not None else 0
        everyone_ok, most = self.votes.vote(error is None, BACKWARD, calls)
        self.votes.stop_unless(everyone_ok, error)
        part = None
        try:
            with adapters_off(self.served.model) if deferred.without_adapters else contextlib.nullcontext():
                out = run_forward(self.served, plan, most - calls, trunk_mode="replay", update_pass=True)
            if k is None:
                heads = [t for v in out.heads.values() for t in (v.values() if isinstance(v, dict) else [v])]
                part = graph_zero(out.candidate_scores, *heads)
            else:
                part = pass_surrogate(deferred, k, out, grads, contexts_done)
        except Exception as err:  # noqa: BLE001 - voted on, then raised
            error = err
        self.votes.stop_unless(self.votes.vote(error is None, BACKWARD)[0], error)
        return part
