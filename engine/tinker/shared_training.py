"""The ``forward_backward`` / ``forward`` requests of several Tinker training clients in one Caller call.

Each training client is a LoRA adapter of one served model, and runs its requests one at a time in ``seq_id``
order. Requests of different clients that arrive together (within a few milliseconds, the sampler's window) with the
same loss, loss settings and direction (``forward_only``) go out as one ``forward_backward`` whose datums name their
client's adapter: the servers run them in one pass, each token on its own adapter, and each adapter gets the
gradients of its own datums (:mod:`llmrl.engine.model.token_adapters`). Each client gets back its own datums'
outputs, and the loss summed over them. A call of several clients that fails for any reason (one client's input, a
non-finite loss, memory) is sent again client by client, so the failure is only the client's at fault: the servers
hold every adapter's earlier gradients apart during such a call and discard only the call's own
(:func:`llmrl.engine.model.training.client_steps.set_aside`). The calls are sent in turn, the client served least
recently first (:class:`~llmrl.engine.tinker.batching.CallBatcher`), so a client sending long requests delays another's
short one by the calls already sent, never more.

A service with one training client sends its requests at once, without the window.

This module groups and splits training requests; the Tinker mapping of each is :mod:`llmrl.engine.tinker.service`'s.
"""

from __future__ import annotations

from llmrl.engine.adapter_names import one_adapter_or_rows
from llmrl.engine.tinker.batching import CallBatcher

MOST_REQUESTS = 64  # training requests of one call at most


class SharedTraining:
    """``run(adapter, data, loss_fn, loss_fn_config, forward_only, together)``: one client's request, alone or (with
    ``together``) in a call with other clients' requests; returns ``{"outputs": [...], "loss": float}``."""

    def __init__(self, caller, llm: str, in_flight: int, window: float = 0.02):
        self.caller, self.llm = caller, llm
        self.batcher = CallBatcher(self._call, window=window, most=MOST_REQUESTS, in_flight=in_flight,
                                   shared=lambda key: key[1], split=lambda err: True)

    def run(self, adapter: str, data: list[dict], loss_fn: str, loss_fn_config: dict | None, forward_only: bool,
            together: bool) -> dict:
        settings = (loss_fn, tuple(sorted((loss_fn_config or {}).items())), forward_only)
        if not together:
            return self._call([(adapter, settings)], [data])[0]
        return self.batcher.submit((adapter, settings), data).result()

    def _call(self, keys: list[tuple], requests: list[list[dict]]) -> list[dict]:
        """One Caller call for ``requests`` (each a client's datums; ``keys``: each one's (adapter, settings))."""
        loss_fn, config, forward_only = keys[0][1]
        adapters = one_adapter_or_rows([adapter for (adapter, _), data in zip(keys, requests) for _ in data])
        call = self.caller.forward if forward_only else self.caller.forward_backward
        out = call([datum for data in requests for datum in data], loss_fn, dict(config) or None, llm=self.llm,
                   peft_adapter=adapters)
        outputs = [{k: v for k, v in o.items() if k in ("logprobs", "elementwise_loss")}
                   for o in out["loss_fn_outputs"]]
        if len(requests) == 1:
            return [{"outputs": outputs, "loss": out["metrics"]["loss:sum"]}]
        results, start = [], 0
        for data in requests:
            mine, start = outputs[start:start + len(data)], start + len(data)
            results.append({"outputs": mine, "loss": sum(float(o["elementwise_loss"].double().sum()) for o in mine)})
        return results
