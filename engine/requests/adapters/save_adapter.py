"""The ``save_adapter`` request kind, behind ``Caller.save_adapter``: write one LoRA adapter's state (weights, how to
make it again, optimizer state) in a new folder, on every rank of the LLM (every replica must hold the same adapters
and snapshots); the first replica's answer is returned.

Client half: the Caller checks the adapter's name and that the folder does not exist. Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.save_adapter` (:mod:`llmrl.engine.model.training.adapter_state`).
This module changes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "save_adapter"


@dataclass(frozen=True)
class SaveAdapterRequest:
    name: str | None  # the adapter saved (None: the active one)
    path: str  # the new folder, absolute


def send(run: Run, llm: str, request: SaveAdapterRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: SaveAdapterRequest):
    result = replica.backend.save_adapter(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=SaveAdapterRequest, send=send, handle=handle, backend_method="save_adapter",
            caller_methods=("save_adapter",))
