"""The messages of the client-server protocol, as small picklable classes.

Client -> server: :class:`Request` (a numbered call with its kind and this rank's share of the
arguments) and :class:`Shutdown`. Server -> client: :class:`Hello` once, :class:`Heartbeat` every
``timeouts.heartbeat`` seconds, and one :class:`Reply` per request, in request order.

This module only defines shapes; transport lives in :mod:`llmrl.engine.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Request kinds.
SETUP = "setup"
SCORE = "score"
GENERATE = "generate"
UPDATE = "update"
SAVE = "save"
PING = "ping"
STATS = "stats"
STATE_DICT = "state_dict"
SLEEP = "sleep"  # test hook: hold a rank busy without computing

KINDS = (SETUP, SCORE, GENERATE, UPDATE, SAVE, PING, STATS, STATE_DICT, SLEEP)


@dataclass
class Request:
    id: int
    kind: str
    payload: dict[str, Any] = field(default_factory=dict)


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


def is_per_sample(value, n: int) -> bool:
    """Whether a keyword argument of ``update`` holds one entry per sample (and is sliced with the batch):
    any sized value of length ``n`` except strings, bytes and mappings."""
    if isinstance(value, (str, bytes, dict)):
        return False
    try:
        return len(value) == n
    except TypeError:
        return False
