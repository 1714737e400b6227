"""The client's links while it closes: a server rank that connects then (a script that ended as the rank came up,
its --help) is admitted and told to stop cleanly. It used to be refused as if it lacked the run's secret, and exit 1."""

from __future__ import annotations

import threading

from llmrl.engine.client.links import ServerLinks
from llmrl.engine.transport import frames, messages, rendezvous

SECRET = b"c" * 32


def connect(address, rank: int) -> frames.Connection:
    link = frames.connect(address, SECRET, rank, timeout=5)
    messages.send(link, messages.Hello(rank=rank, llm="main", replica=0, tp_rank=0, host="here", pid=0))
    return link


def test_a_rank_that_connects_while_the_client_closes_is_told_to_stop_cleanly():
    listener = rendezvous.listen("127.0.0.1")
    address = listener.getsockname()  # (the stop closes the listener)
    links = ServerLinks(listener, SECRET, [1, 2], heartbeat=0.05, dead_after=600.0)
    early = connect(address, 1)
    with links._lock:  # rank 1 admitted before the stop, which then waits for it to hang up while rank 2 comes
        assert links._lock.wait_for(lambda: 1 in links.hellos, timeout=30)
    closing = threading.Thread(target=links.shutdown, kwargs={"abort": False, "reason": "done", "wait": 60})
    closing.start()
    assert isinstance(messages.receive(early), messages.Shutdown)
    late = connect(address, 2)
    stop = messages.receive(late)
    assert isinstance(stop, messages.Shutdown) and not stop.abort and "before this rank was up" in stop.reason
    early.close()  # rank 1 hangs up: the stop ends
    closing.join(60)
    assert not closing.is_alive() and links.dead == {} and links.stuck == []
    late.close()
