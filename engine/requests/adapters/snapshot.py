"""The ``snapshot`` request kind, behind ``Caller.snapshot``: freeze a copy of a LoRA adapter's current weights
(default: the active adapter's) under a new name, read like an adapter while the adapter goes on training, on every
rank of the LLM (every replica must hold the same adapters and snapshots); the first replica's answer is returned.

Client half: the Caller checks the name by llmrl's rule for new names
(:mod:`~llmrl.engine.requests.adapters.checks`). Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.snapshot` (:mod:`llmrl.engine.model.snapshots`). This module changes
nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "snapshot"


@dataclass(frozen=True)
class SnapshotRequest:
    name: str  # the snapshot's name
    source: str | None = None  # the adapter copied (None: the active one)


def send(run: Run, llm: str, request: SnapshotRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: SnapshotRequest):
    result = replica.backend.snapshot(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=SnapshotRequest, send=send, handle=handle, backend_method="snapshot",
            caller_methods=("snapshot",))
