"""The ``read_weights`` request kind, the first half of ``Caller.sync_weights``: the learner's weights to sync (one
LoRA adapter's, or the whole model's) and their policy version, as CPU tensors.

Client half: every rank of the source LLM takes part (ZeRO-3 partitions and tensor-parallel shards are gathered
collectively); the first rank answers. Server half: :func:`llmrl.engine.model.weight_sync.read_to_send`. With a
target LLM named (``via="group"``), the group leader stages the weights for its sender thread to that LLM's ranks
and answers with their layout and digest instead (:mod:`llmrl.engine.model.weight_channel`). The second half is
:mod:`llmrl.engine.requests.write_weights`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, every_rank

NAME = "read_weights"


@dataclass(frozen=True)
class ReadWeightsRequest:
    adapter: str | None = None  # the LoRA adapter read (None: the active one; the whole model without LoRA)
    to: str | None = None  # the target LLM the leader sends the weights to over a group (None: to the client)
    to_rank_count: int = 0  # how many ranks that target has


def send(run: Run, llm: str, request: ReadWeightsRequest) -> Future:
    ranks = every_rank(run, [llm])
    return run.submit(NAME, [(ranks, request)], lambda values: values[ranks[0]])


def handle(replica, request: ReadWeightsRequest):
    return replica.backend.read_weights(request)


KIND = Kind(name=NAME, payload=ReadWeightsRequest, send=send, handle=handle, backend_method="read_weights",
            caller_methods=("sync_weights", "sync_weights_async"))
