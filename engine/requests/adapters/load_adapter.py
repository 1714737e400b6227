"""The ``load_adapter`` request kind, behind ``Caller.load_adapter``: load a state written by ``save_adapter`` into an
adapter (created when it does not exist), on every rank of the LLM (every replica must hold the same adapters and
snapshots); the first replica's answer is returned.

Client half: the Caller checks the name, that the folder exists and ``optimizer``. Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.load_adapter` (:mod:`llmrl.engine.model.training.adapter_state`,
which refuses a damaged state naming the field). This module changes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "load_adapter"


@dataclass(frozen=True)
class LoadAdapterRequest:
    name: str  # the adapter loaded into
    path: str  # the folder save_adapter wrote, absolute
    optimizer: bool = True  # load the saved optimizer state (else a fresh one)


def send(run: Run, llm: str, request: LoadAdapterRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: LoadAdapterRequest):
    result = replica.backend.load_adapter(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=LoadAdapterRequest, send=send, handle=handle, backend_method="load_adapter",
            caller_methods=("load_adapter",))
