"""A server rank's reader survives whatever a client sends: messages a client never sends (a Hello, a Heartbeat, a
Reply, an unknown type, a header that is not an object) are logged and dropped, a request whose header or payload
cannot be read is answered with an error in its turn, and the requests around them are served as usual."""

from __future__ import annotations

import collections
import socket
import threading
from types import SimpleNamespace

from llmrl.engine.log import logger
from llmrl.engine.requests.admin import PingRequest
from llmrl.engine.server.serve import Server
from llmrl.engine.transport import frames, messages


class Unloadable:
    def __reduce__(self):
        return _explode, ()


def _explode():
    raise RuntimeError("no such class on the server")


def _server_on(link: frames.Connection) -> Server:
    role = SimpleNamespace(global_rank=1, llm="main", replica=0, tp_rank=0)
    server = Server(SimpleNamespace(), role)
    server.link = link
    server.replica = SimpleNamespace(handled=collections.Counter(), ready=True, role=role,
                                     device=SimpleNamespace(type="cpu"))
    return server


def test_messages_a_client_never_sends_are_dropped_and_bad_requests_answered_in_order(caplog):
    if not logger.propagate:  # llmrl's logger stops propagating once configured
        logger.addHandler(caplog.handler)
    near, far = socket.socketpair()
    client, link = frames.Connection(near), frames.Connection(far)
    server = _server_on(link)
    reader = threading.Thread(target=server._read_loop, daemon=True)
    reader.start()

    messages.send(client, messages.Request(1, "ping", PingRequest()))
    messages.send(client, messages.Hello(rank=0, llm="main", replica=0, tp_rank=0, host="h", pid=1))
    messages.send(client, messages.Heartbeat(busy_with=None))
    messages.send(client, messages.Reply(7, 0, value="stray"))
    client.send({"type": "no-such-type"})
    client.send(["not", "an", "object"])
    client.send({"type": "hello", "rank": 0})  # a known type with missing fields
    client.send({"type": "request", "id": 2})  # a numbered request without its kind
    client.send(["a list", "header"], {"x": Unloadable()})  # neither a header nor a body that can be read
    messages.send(client, messages.Request(3, "ping", {"x": Unloadable()}))
    messages.send(client, messages.Request(4, "ping", PingRequest()))
    messages.send(client, messages.Shutdown())

    served = threading.Thread(target=server.serve, daemon=True)
    served.start()
    replies = [messages.receive(client) for _ in range(4)]
    served.join(30)
    assert not served.is_alive() and reader.is_alive(), "the server stopped at the shutdown, its reader lives on"

    assert [r.id for r in replies] == [1, 2, 3, 4]
    assert replies[0].value == {"rank": 1} and replies[3].value == {"rank": 1}
    assert replies[0].error is None and replies[3].error is None
    assert "'request' message with wrong fields" in replies[1].error.message
    assert "cannot decode the 'ping' request" in replies[2].error.message
    assert "no such class on the server" in replies[2].error.message
    assert server.replica.handled["ping"] == 2
    dropped = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    for what in ("Hello", "Heartbeat", "Reply", "unknown message type 'no-such-type'", "not a JSON object",
                 "'hello' message with wrong fields", "'a list'"):
        assert any(what in line for line in dropped), (what, dropped)
    assert len(dropped) == 7
    assert "can import" in replies[2].error.message  # a payload the server cannot build: the hint says what can
    assert "can import" not in replies[1].error.message  # a header's fault is not the payload's
    server.close()
    client.close()
    logger.removeHandler(caplog.handler)


def test_a_clean_stop_while_loading_with_nothing_queued_exits_zero_at_once(monkeypatch):
    """A script that ends before making its Caller leaves its servers loading; a rank told to stop cleanly then
    exits 0 at once (reporting it), instead of finishing a load nobody needs while the client waits for it."""
    import llmrl.engine.server.serve as serve

    left, reported = [], []
    ended = threading.Event()

    def fake_leave(code):
        left.append(code)
        ended.set()
        threading.Event().wait()  # the real one never returns

    monkeypatch.setattr(serve, "leave", fake_leave)
    near, far = socket.socketpair()
    client, link = frames.Connection(near), frames.Connection(far)
    server = _server_on(link)
    server.on_exit = reported.append
    threading.Thread(target=server._read_loop, daemon=True).start()
    messages.send(client, messages.Shutdown())
    assert ended.wait(30)
    assert left == [0] and reported == [0] and server.closed
    client.close()


def test_a_clean_stop_after_queued_requests_waits_for_them(monkeypatch):
    import llmrl.engine.server.serve as serve

    left = []
    monkeypatch.setattr(serve, "leave", lambda code: left.append(code) or threading.Event().wait())
    near, far = socket.socketpair()
    client, link = frames.Connection(near), frames.Connection(far)
    server = _server_on(link)
    threading.Thread(target=server._read_loop, daemon=True).start()
    messages.send(client, messages.Request(1, "ping", PingRequest()))
    messages.send(client, messages.Shutdown())
    served = threading.Thread(target=server.serve, daemon=True)
    served.start()  # the load ends after the stop arrived
    assert messages.receive(client).value == {"rank": 1}
    served.join(30)
    assert not served.is_alive() and left == []  # served, then stopped by serve(); never left early
    server.close()
    client.close()
