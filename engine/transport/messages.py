"""The messages between the client and the servers, and how each one rides in a frame.

Client -> server: :class:`Request` (a numbered call: its kind and this rank's share, a typed payload declared
by the kind's module in :mod:`llmrl.engine.requests`) and :class:`Shutdown`. Server -> client: :class:`Hello`
once, :class:`Heartbeat` every ``timeouts.heartbeat`` seconds, and one :class:`Reply` per request, in request
order. Everything that identifies a message (its type, id, kind, rank, an error's text) travels in the
frame's JSON header; only a request's payload and a reply's value are pickled. :func:`receive` therefore
always knows which message a bad body belonged to (:class:`~llmrl.engine.transport.frames.UndecodableBody`).

This module only defines shapes and their framing; bytes move in :mod:`llmrl.engine.transport.frames`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from llmrl.engine.transport.frames import Connection, UndecodableBody


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


_SMALL_TYPES = {"hello": Hello, "heartbeat": Heartbeat, "shutdown": Shutdown}


def to_frame(message) -> tuple[dict, Any]:
    """The (JSON header, pickled body) of a message."""
    if isinstance(message, Request):
        return {"type": "request", "id": message.id, "kind": message.kind}, message.payload
    if isinstance(message, Reply):
        error = None if message.error is None else _bounded(asdict(message.error))
        return {"type": "reply", "id": message.id, "rank": message.rank, "error": error}, message.value
    for name, cls in _SMALL_TYPES.items():
        if isinstance(message, cls):
            return {"type": name, **asdict(message)}, None
    raise TypeError(f"not a message: {type(message).__name__}")


_ERROR_BYTES = 24_000  # the most an error's message, and its traceback, take in JSON: a header holds 64 KiB


def _bounded(error: dict) -> dict:
    """An error whose message and traceback are each cut in the middle to at most ``_ERROR_BYTES`` bytes of JSON
    (an updater may raise with a long list in its message; the reply's header must still fit)."""
    import json

    for key in ("message", "traceback"):
        text, half = error[key], _ERROR_BYTES // 2
        while len(json.dumps(error[key])) > _ERROR_BYTES:  # up to 6 bytes of JSON a character
            half //= 2
            error[key] = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[len(text) - half:]}"
    return error


class UnknownMessage(ValueError):
    """A frame that arrived whole but whose header is not one of these messages (an unknown type, a missing or
    extra field). The connection goes on; :attr:`header` says what came."""

    def __init__(self, header: dict, reason: str):
        super().__init__(f"{reason} (header {str(header)[:300]})")
        self.header = header


def from_frame(header: dict, body: Any):
    if not isinstance(header, dict):
        raise UnknownMessage({"header": header}, "a header that is not a JSON object")
    kind = header.get("type")
    try:
        if kind == "request":
            return Request(header["id"], header["kind"], body)
        if kind == "reply":
            error = header.get("error")
            return Reply(header["id"], header["rank"], body, None if error is None else ErrorInfo(**error))
        if kind in _SMALL_TYPES:
            return _SMALL_TYPES[kind](**{k: v for k, v in header.items() if k != "type"})
    except (KeyError, TypeError) as err:
        raise UnknownMessage(header, f"a {kind!r} message with wrong fields: {err}") from None
    raise UnknownMessage(header, f"unknown message type {kind!r}")


def send(connection: Connection, message) -> None:
    connection.send(*to_frame(message))


def send_quietly(connection: Connection, message) -> None:
    """Send ``message`` if the peer is still there (a last word before hanging up); a closed link is no error."""
    try:
        send(connection, message)
    except OSError:
        pass


def receive(connection: Connection):
    """The next message. A message whose body cannot be decoded raises
    :class:`~llmrl.engine.transport.frames.UndecodableBody` with its header, and one whose header is not a message
    raises :class:`UnknownMessage`; the connection goes on after either."""
    header, body = connection.recv()
    return from_frame(header, body)


__all__ = ["ErrorInfo", "Heartbeat", "Hello", "Reply", "Request", "Shutdown", "UndecodableBody", "UnknownMessage",
           "from_frame", "receive", "send", "send_quietly", "to_frame"]
