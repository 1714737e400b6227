"""The ``create_adapter`` request kind, behind ``Caller.create_adapter``: add a LoRA adapter to a running LLM, with an
optimizer state of its own, on every rank of the LLM (every replica must hold the same adapters and snapshots); the
first replica's answer is returned.

Client half: the Caller checks the name by llmrl's rule for new names and the adapter's shape (rank, alpha, seed,
targets: :mod:`~llmrl.engine.requests.adapters.checks`). Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.create_adapter` (:mod:`llmrl.engine.model.training.new_adapters`).
This module changes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "create_adapter"


@dataclass(frozen=True)
class CreateAdapterRequest:
    name: str  # the new adapter's name
    rank: int  # LoRA's r
    alpha: float | None = None  # LoRA's alpha (None: 2 x rank)
    seed: int = 0  # its initial weights are drawn from this seed
    targets: str | list[str] | None = None  # 'attention', 'mlp', 'unembed', module names (None: all linears)


def send(run: Run, llm: str, request: CreateAdapterRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: CreateAdapterRequest):
    result = replica.backend.create_adapter(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=CreateAdapterRequest, send=send, handle=handle, backend_method="create_adapter",
            caller_methods=("create_adapter",))
