"""The ``write_weights`` request kind, the second half of ``Caller.sync_weights``: the weights that
:mod:`llmrl.engine.requests.read_weights` read from the learner, written in place into the sampler on every rank
of every replica, with the learner's policy version.

Client half: the same payload to every rank of the target LLM; the first replica's answer is returned. Server half:
:func:`llmrl.engine.model.weight_sync.write_sent`: the weights the payload carries, or those received over the
source-target group that its ``staged`` describes, written by ``write_weights``, which checks every tensor before
it writes any. A write sent ``in_flight`` is served in its turn, or earlier: inside a ``generate`` in progress,
between two decode batches, when it is the next request queued
(:meth:`llmrl.engine.server.serve.Server._take_queued_write`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "write_weights"


@dataclass(frozen=True)
class WriteWeightsRequest:
    weights: dict | None  # name -> CPU tensor, named as in the module's state dict (None: sent over a group)
    adapter: str | None  # the adapter written into (None: the whole model)
    version: int  # the learner's policy version of these weights
    source: str  # the LLM they were read from, for messages
    checks: dict | None = None  # the source adapter's LoRA scalings and a sample of its base weights, compared first
    in_flight: bool = False  # taken by a `generate` in progress between two decode batches (the next one queued)
    staged: object = None  # weight_channel.Staged: the weights come over the source-target group, as it describes


def send(run: Run, llm: str, request: WriteWeightsRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: WriteWeightsRequest):
    result = replica.backend.write_weights(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=WriteWeightsRequest, send=send, handle=handle, backend_method="write_weights",
            caller_methods=("sync_weights", "sync_weights_async"))
