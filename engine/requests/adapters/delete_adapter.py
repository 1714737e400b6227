"""The ``delete_adapter`` request kind, behind ``Caller.delete_adapter``: delete an adapter made by ``create_adapter``:
its weights, optimizer state and cached keys, on every rank of the LLM (every replica must hold the same adapters
and snapshots); the first replica's answer is returned.

Client half: the Caller checks the name (an identifier). Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.delete_adapter` (:mod:`llmrl.engine.model.training.new_adapters`).
This module changes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "delete_adapter"


@dataclass(frozen=True)
class DeleteAdapterRequest:
    name: str  # the adapter's name


def send(run: Run, llm: str, request: DeleteAdapterRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: DeleteAdapterRequest):
    result = replica.backend.delete_adapter(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=DeleteAdapterRequest, send=send, handle=handle, backend_method="delete_adapter",
            caller_methods=("delete_adapter",))
