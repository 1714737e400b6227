"""The messages between the client and the servers, as small picklable classes.

Client -> server: :class:`Request` (a numbered call: its kind and this rank's share, a typed payload
declared by the kind's module in :mod:`llmrl.engine.requests`) and :class:`Shutdown`. Server -> client:
:class:`Hello` once, :class:`Heartbeat` every ``timeouts.heartbeat`` seconds, and one :class:`Reply` per
request, in request order.

This module only defines shapes; frames are in :mod:`llmrl.engine.transport.frames`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Request:
    id: int
    kind: str
    payload: Any = None


@dataclass
class Shutdown:
    reason: str = "client closed"
    abort: bool = False  # the run failed: exit at once, non-zero, without waiting for work in progress


@dataclass
class Hello:
    rank: int
    llm: str
    replica: int
    tp_rank: int
    host: str
    pid: int


@dataclass
class Heartbeat:
    busy_with: int | None = None  # id of the request being served, if any


@dataclass
class ErrorInfo:
    """An exception raised on a server, reduced to what the client needs to re-raise it."""

    type: str
    message: str
    traceback: str
    plugin: str | None = None
    aborted_by_peer: bool = False  # this rank stopped because another rank of its LLM failed


@dataclass
class Reply:
    id: int
    rank: int
    value: Any = None
    error: ErrorInfo | None = None
