"""Dead-rank detection on the client: a closed connection or a silent server fails waiting calls at once,
naming the rank, and every later call fails immediately."""

from __future__ import annotations

import threading
import time

import pytest

from llmrl.engine.client.links import ServerLinks
from llmrl.engine.errors import RequestError, ServerDiedError
from llmrl.engine.transport import frames, messages, rendezvous

TOKEN = b"t" * 32


def fake_server(address, rank, *, heartbeats: bool, answer: bool, stop: threading.Event):
    link = frames.connect(address, TOKEN, rank, timeout=5)
    link.send(messages.Hello(rank=rank, llm="main", replica=0, tp_rank=0, host="here", pid=0))
    while not stop.is_set():
        if heartbeats:
            link.send(messages.Heartbeat())
        if answer:
            link.sock.settimeout(0.05)
            try:
                request = link.recv()
                link.send(messages.Reply(request.id, rank, value={"echo": request.payload}))
            except (TimeoutError, OSError):
                pass
        time.sleep(0.05)
    link.close()


def start(rank_behaviours, dead_after=10.0):
    listener = rendezvous.listen("127.0.0.1")
    links = ServerLinks(listener, TOKEN, sorted(rank_behaviours), heartbeat=0.05, dead_after=dead_after)
    stops = {}
    for rank, behaviour in rank_behaviours.items():
        stops[rank] = threading.Event()
        threading.Thread(target=fake_server, args=(listener.getsockname(), rank), kwargs={**behaviour,
                         "stop": stops[rank]}, daemon=True).start()
    links.wait_connected(10)
    return links, stops


def test_replies_are_routed_and_assembled():
    links, stops = start({1: {"heartbeats": True, "answer": True}, 2: {"heartbeats": True, "answer": True}})
    future = links.submit("ping", [([1], {"x": 1}), ([2], {"x": 2})], lambda values: sorted(values.items()))
    assert future.result(5) == [(1, {"echo": {"x": 1}}), (2, {"echo": {"x": 2}})]
    for stop in stops.values():
        stop.set()
    links.shutdown(abort=False, reason="test", wait=2)


def test_a_closed_connection_fails_waiting_calls_naming_the_rank():
    # The heartbeat deadline is far beyond the wait below: only noticing the closed socket can fail the call.
    links, stops = start({1: {"heartbeats": True, "answer": False}, 2: {"heartbeats": True, "answer": True}},
                         dead_after=600.0)
    future = links.submit("score", [([1, 2], {})], lambda values: values)
    stops[1].set()  # rank 1 hangs up without answering
    with pytest.raises(ServerDiedError) as err:
        future.result(10)
    assert err.value.rank == 1 and "connection closed" in str(err.value)
    with pytest.raises(ServerDiedError, match="rank 1"):
        links.submit("score", [([2], {})], lambda values: values)
    stops[2].set()
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_silent_server_is_declared_dead():
    links, stops = start({1: {"heartbeats": False, "answer": False}}, dead_after=0.5)
    future = links.submit("score", [([1], {})], lambda values: values)
    with pytest.raises(ServerDiedError, match="no heartbeat"):
        future.result(10)
    stops[1].set()
    links.shutdown(abort=True, reason="test", wait=2)


def test_server_errors_become_request_errors_with_the_rank():
    listener = rendezvous.listen("127.0.0.1")
    links = ServerLinks(listener, TOKEN, [3], heartbeat=0.05, dead_after=10)

    def erring_server():
        link = frames.connect(listener.getsockname(), TOKEN, 3, timeout=5)
        link.send(messages.Hello(rank=3, llm="main", replica=0, tp_rank=0, host="here", pid=0))
        request = link.recv()
        error = messages.ErrorInfo("ValueError", "context 0 is too long", "Traceback ...", plugin=None)
        link.send(messages.Reply(request.id, 3, error=error))
        time.sleep(0.5)
        link.close()

    threading.Thread(target=erring_server, daemon=True).start()
    links.wait_connected(10)
    with pytest.raises(RequestError) as err:
        links.submit("score", [([3], {})], lambda values: values).result(5)
    assert err.value.rank == 3 and str(err.value) == "[rank 3] ValueError: context 0 is too long"
    links.shutdown(abort=False, reason="test", wait=2)
