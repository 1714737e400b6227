"""The ``drop_snapshot`` request kind, behind ``Caller.drop_snapshot``: delete a snapshot and free its memory, on every
rank of the LLM (every replica must hold the same adapters and snapshots); the first replica's answer is returned.

Client half: the Caller checks the name (an identifier). Server half:
:meth:`~llmrl.engine.model.backend.ModelBackend.drop_snapshot` (:mod:`llmrl.engine.model.snapshots`). This module
changes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, to_every_replica

NAME = "drop_snapshot"


@dataclass(frozen=True)
class DropSnapshotRequest:
    name: str  # the snapshot's name


def send(run: Run, llm: str, request: DropSnapshotRequest) -> Future:
    return to_every_replica(run, NAME, llm, request)


def handle(replica, request: DropSnapshotRequest):
    result = replica.backend.drop_snapshot(request)
    return result if replica.answers else None


KIND = Kind(name=NAME, payload=DropSnapshotRequest, send=send, handle=handle, backend_method="drop_snapshot",
            caller_methods=("drop_snapshot",))
