"""The ``save`` request kind: every rank of every LLM writes its part of a checkpoint into a staging folder.

Client half: one payload for every server rank; the call completes when all have written. The staging
folder and the swap into place are the client's (:mod:`llmrl.engine.client.saving`). Server half: the
backend writes this rank's part (collective over the LLM's ranks). This module does not choose what a
checkpoint holds (the backend and :mod:`llmrl.engine.checkpoint_layout` do).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.requests.base import Kind, Run, every_rank

NAME = "save"


@dataclass(frozen=True)
class SaveRequest:
    folder: str  # the staging folder, on a filesystem every node sees


def send(run: Run, folder: str) -> Future:
    return run.submit(NAME, [(every_rank(run), SaveRequest(folder))], lambda values: None)


def handle(replica, request: SaveRequest):
    replica.backend.save(request)
    return True


KIND = Kind(name=NAME, payload=SaveRequest, send=send, handle=handle, backend_method="save", caller_methods=("save",))
