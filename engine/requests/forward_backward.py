"""The ``forward_backward`` request kind, behind ``Caller.forward_backward`` and ``Caller.forward``: per-token
log-probs of token-level data, a built-in loss on them, and (for ``forward_backward``) its gradients, accumulated
on the servers until ``optim_step``.

Client half: the data are checked (:mod:`llmrl.engine.requests.datums`) and the loss's configuration too
(:func:`llmrl.engine.token_losses.token_loss_settings`) before anything is sent; the sequences are split across the
replicas by their token counts, every replica taking part (their backward passes reduce gradients together). The
answers come back in datum order: each datum's ``logprobs`` and ``elementwise_loss`` (one value per target token),
and the loss summed over every datum (``metrics["loss:sum"]``); given the samples' ``policy_versions``, their
staleness against the trained weights (``metrics["staleness:mean"]``, ``["staleness:max"]``). ``peft_adapter`` may
list one adapter per datum: each replica's share then carries its datums' names and every adapter of the call, and
runs them in one pass (:mod:`llmrl.engine.model.token_adapters`). Server half: the backend runs
:func:`llmrl.engine.model.training.client_steps.forward_backward` on the replica's share.

This module computes nothing; the losses are :func:`llmrl.engine.token_losses.token_loss`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.adapter_names import ContextAdapters, check_adapters, one_adapter_or_rows
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.policy_versions import check_policy_versions, staleness_stats
from llmrl.engine.requests.base import Kind, Run, replica_parts, split_by_cost
from llmrl.engine.requests.datums import Sequence

NAME = "forward_backward"


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """One replica's share of a forward_backward (or forward) call."""

    sequences: list[Sequence]
    loss_fn: str | None  # None: log-probs only (forward)
    loss_fn_config: dict = field(default_factory=dict)
    backward: bool = True
    adapter: str | list[str] | None = None  # a list: each sequence's (with ``call_adapters``)
    call_adapters: tuple[str, ...] | None = None  # every adapter of the whole call, where sequences name their own
    first_index: int = 0  # position of the first sequence in the whole call (for error messages)
    policy_versions: list | None = None  # the samples' policy versions (None: not given), for their staleness

    def adapters(self):
        """The share's adapter: a name or None, or a :class:`ContextAdapters` where the call's sequences name
        several."""
        if self.call_adapters is None:
            return self.adapter
        return ContextAdapters(list(self.adapter), tuple(self.call_adapters))


def send(run: Run, llm: str, sequences: list[Sequence], loss_fn: str | None, loss_fn_config: dict, *,
         backward: bool, adapter: str | list[str] | None, policy_versions: list | None = None) -> Future:
    adapter = one_adapter_or_rows(check_adapters(adapter, len(sequences), "datum"))
    call = tuple(dict.fromkeys(adapter)) if isinstance(adapter, list) else None
    if policy_versions is not None:
        try:
            policy_versions = check_policy_versions(policy_versions, len(sequences), "policy_versions")
        except ValueError as err:
            raise InvalidArgument(f"{err}; nothing was sent") from None
    bounds = split_by_cost([float(len(s.tokens)) for s in sequences], len(run.replicas(llm)))

    def share(start: int, stop: int) -> ForwardBackwardRequest:
        versions = None if policy_versions is None else policy_versions[start:stop]
        return ForwardBackwardRequest(sequences[start:stop], loss_fn, dict(loss_fn_config), backward=backward,
                                      adapter=adapter[start:stop] if call else adapter, call_adapters=call,
                                      first_index=start, policy_versions=versions)

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=True)

    def assemble(values: dict) -> dict:
        outputs, loss, stale = [], 0.0, []
        for leader in leaders:
            outputs.extend(values[leader]["outputs"])
            loss += values[leader]["loss"]
            stale += values[leader].get("staleness") or []
        for seq, out in zip(sequences, outputs):
            if seq.unscored:  # the forward read the next input token there, not the datum's target
                out["logprobs"][list(seq.unscored)] = float("nan")
        metrics = {"loss:sum": loss} if loss_fn is not None else {}
        metrics.update({f"staleness:{k.split('_')[1]}": v for k, v in staleness_stats(stale).items()})
        return {"loss_fn_outputs": outputs, "metrics": metrics}

    return run.submit(NAME, parts, assemble)


def handle(replica, request: ForwardBackwardRequest):
    result = replica.backend.forward_backward(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=ForwardBackwardRequest, send=send, handle=handle, backend_method="forward_backward",
            caller_methods=("forward_backward_async", "forward_backward", "forward_async", "forward",
                            "forward_backward_custom"))
