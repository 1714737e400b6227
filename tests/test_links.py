"""The client's links to the servers (fake servers in threads): replies are routed, a closed connection or a
silent server fails waiting calls at once naming the rank, and the reader threads survive whatever they read
(an undecodable result fails its own call; a corrupt frame ends that link loudly). A server that is busy
sending, or a client that was stalled, is not declared dead; a send stuck on a frozen server is released."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

import pytest

from llmrl.engine.client.links import ServerLinks
from llmrl.engine.errors import InvalidArgument, RequestError, ServerDiedError
from llmrl.engine.transport import frames, messages, rendezvous

SECRET = b"s" * 32


def hello(link, rank):
    messages.send(link, messages.Hello(rank=rank, llm="main", replica=0, tp_rank=0, host="here", pid=0))


def fake_server(address, rank, *, heartbeats: bool, answer: bool, stop: threading.Event):
    link = frames.connect(address, SECRET, rank, timeout=5)
    hello(link, rank)
    while not stop.is_set():
        if heartbeats:
            messages.send(link, messages.Heartbeat())
        if answer:
            link.sock.settimeout(0.05)
            try:
                request = messages.receive(link)
                if not isinstance(request, messages.Request):  # a shutdown: the test is over
                    break
                messages.send(link, messages.Reply(request.id, rank, value={"echo": request.payload}))
            except (TimeoutError, OSError):
                pass
        time.sleep(0.05)
    link.close()


def start(rank_behaviours, dead_after=10.0, heartbeat=0.05):
    listener = rendezvous.listen("127.0.0.1")
    links = ServerLinks(listener, SECRET, sorted(rank_behaviours), heartbeat=heartbeat, dead_after=dead_after)
    stops = {}
    for rank, behaviour in rank_behaviours.items():
        stops[rank] = threading.Event()
        threading.Thread(target=fake_server, args=(listener.getsockname(), rank), kwargs={**behaviour,
                         "stop": stops[rank]}, daemon=True).start()
    links.wait_connected(10)
    return links, stops


def scripted_server(script, rank=3, dead_after=10.0):
    """Links to one fake server that runs ``script(link)`` after its hello."""
    listener = rendezvous.listen("127.0.0.1")
    links = ServerLinks(listener, SECRET, [rank], heartbeat=0.05, dead_after=dead_after)

    def run():
        link = frames.connect(listener.getsockname(), SECRET, rank, timeout=5)
        hello(link, rank)
        script(link)

    threading.Thread(target=run, daemon=True).start()
    links.wait_connected(10)
    return links


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
    def script(link):
        request = messages.receive(link)
        error = messages.ErrorInfo("ValueError", "context 0 is too long", "Traceback ...", plugin=None)
        messages.send(link, messages.Reply(request.id, 3, error=error))
        time.sleep(0.5)
        link.close()

    links = scripted_server(script)
    with pytest.raises(RequestError) as err:
        links.submit("score", [([3], {})], lambda values: values).result(5)
    assert err.value.rank == 3 and str(err.value) == "[rank 3] ValueError: context 0 is too long"
    links.shutdown(abort=False, reason="test", wait=2)


def explode():
    raise RuntimeError("this value cannot be rebuilt here")


class Unloadable:
    """Pickles fine; unpickling calls ``explode`` (as a class the client cannot import would fail)."""

    def __reduce__(self):
        return explode, ()


def echo_server(link):
    """Answers every request with its payload; "bad" and "exit" with values whose unpickling fails (raises, or
    calls sys.exit) on the client."""
    while True:
        try:
            request = messages.receive(link)
        except (EOFError, OSError):
            return
        if not isinstance(request, messages.Request):
            return
        unloadable = {"bad": Unloadable, "exit": ExitOnLoad}.get(request.payload)
        value = unloadable() if unloadable is not None else request.payload
        messages.send(link, messages.Reply(request.id, 3, value=value))
        messages.send(link, messages.Heartbeat())


class ExitOnLoad:
    def __reduce__(self):
        return sys.exit, (3,)


@pytest.mark.parametrize("payload, error", [("bad", "cannot be rebuilt here"), ("exit", "SystemExit")])
def test_an_undecodable_result_fails_its_own_call_and_the_link_goes_on(payload, error):
    links = scripted_server(echo_server)
    with pytest.raises(RequestError, match=f"cannot decode rank 3's result.*{error}"):
        links.submit("state_dict", [([3], payload)], lambda values: values[3]).result(5)
    assert links.submit("ping", [([3], "good")], lambda values: values[3]).result(5) == "good"
    assert not links.dead
    links.shutdown(abort=False, reason="test", wait=2)


@pytest.mark.parametrize("garbage", ["huge", "not json"])
def test_a_corrupt_frame_ends_the_link_loudly_and_promptly(garbage):
    def script(link):
        messages.receive(link)
        if garbage == "huge":  # a header announcing far more than max_message_bytes
            link.sock.sendall(frames.PREFIX.pack(10, 1 << 60, 0))
        else:
            link.sock.sendall(frames.PREFIX.pack(4, 0, 0) + b"\xff\x00{[" + b"\0" * 32)  # and a forged tag
        time.sleep(30)

    links = scripted_server(script, dead_after=600.0)
    future = links.submit("score", [([3], {})], lambda values: values)
    with pytest.raises(ServerDiedError, match="cannot be read"):
        future.result(10)
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_request_over_the_size_limit_or_not_picklable_is_refused_before_sending():
    links = scripted_server(lambda link: time.sleep(30))
    links._max_bytes = 1 << 20
    with pytest.raises(InvalidArgument, match="over max_message_bytes"):
        links.submit("score", [([3], b"x" * (2 << 20))], lambda values: values)
    with pytest.raises(InvalidArgument, match="cannot be sent.*picklable"):
        links.submit("generate", [([3], {"logits_processor": [lambda ids, scores: scores]})], lambda values: values)
    assert not links.dead
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_server_sending_a_long_reply_is_alive():
    """Bytes that keep arriving count as life, even before the frame is whole."""
    def script(link):
        request = messages.receive(link)
        data = frames.encode(*messages.to_frame(messages.Reply(request.id, 3, value=b"x" * 3_000_000)))
        blob = b"".join(bytes(memoryview(part)) for part in link.signed(data))
        for i in range(0, len(blob), 100_000):  # 3 MB in 30 pieces over ~3 s, no heartbeat in between
            link.sock.sendall(blob[i:i + 100_000])
            time.sleep(0.1)
        messages.send(link, messages.Heartbeat())
        time.sleep(30)

    links = scripted_server(script, dead_after=1.0)
    assert len(links.submit("state_dict", [([3], None)], lambda values: values[3]).result(30)) == 3_000_000
    assert not links.dead
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_stalled_client_does_not_declare_healthy_servers_dead():
    links, stops = start({1: {"heartbeats": True, "answer": True}}, dead_after=1.0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # this thread keeps the interpreter: no other thread of the client runs
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)
    time.sleep(0.5)  # the watchdog and the readers run again (the heartbeats waited in the socket)
    assert not links.dead
    assert links.submit("ping", [([1], 7)], lambda values: values[1]).result(5) == {"echo": 7}
    stops[1].set()
    links.shutdown(abort=False, reason="test", wait=2)


def test_a_send_to_a_frozen_server_is_released_when_it_is_declared_dead():
    """A frozen server (SIGSTOP) neither reads nor beats: a request larger than the socket buffers blocks its
    sender until the watchdog declares the rank dead and shuts the socket."""
    frozen = threading.Event()

    def script(link):
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        frozen.set()
        time.sleep(60)

    links = scripted_server(script, dead_after=1.0)
    frozen.wait(5)
    with pytest.raises((ServerDiedError, RequestError)):
        links.submit("score", [([3], b"x" * (64 << 20))], lambda values: values).result(30)
    assert 3 in links.dead
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_peer_without_the_secret_is_refused_before_anything_is_decoded():
    listener = rendezvous.listen("127.0.0.1")
    links = ServerLinks(listener, SECRET, [1], heartbeat=0.05, dead_after=10)
    with pytest.raises(frames.AuthenticationError):
        frames.connect(listener.getsockname(), b"w" * 32, 1, timeout=5)
    # A raw peer that claims rank 1 with a made-up proof is dropped too.
    sock = socket.create_connection(listener.getsockname(), timeout=5)
    sock.recv(frames.NONCE)
    sock.sendall(struct.pack("!I", 1) + b"n" * 32 + b"m" * 32)
    assert sock.recv(1) == b""  # closed without an answer
    sock.close()
    assert not links.hellos
    links.shutdown(abort=True, reason="test", wait=2)


def stopping_server(answer_requests: bool):
    """A scripted server that answers requests (or not) and hangs up when told to stop, as a closed LLM's rank."""
    def script(link):
        while True:
            message = messages.receive(link)
            if isinstance(message, messages.Shutdown):
                link.close()
                return
            if answer_requests:
                messages.send(link, messages.Reply(message.id, 3, value="done"))
    return script


def test_a_retired_rank_hangs_up_without_being_dead():
    """Caller.close_llm: the rank answers what was sent before the stop, hangs up, and that is no death; calls to it
    are refused; the link of a rank that is still serving is untouched."""
    links = scripted_server(stopping_server(answer_requests=True), dead_after=600.0)
    pending = links.submit("score", [([3], {})], lambda values: values[3])
    links.retire([3], "test", timeout=10)
    assert pending.result(5) == "done" and links.dead == {} and links.retired == {3}
    with pytest.raises(RuntimeError, match="stopped by close_llm"):
        links.submit("score", [([3], {})], lambda values: values)
    links.shutdown(abort=False, reason="test", wait=2)


def test_a_retired_rank_that_leaves_a_call_unanswered_is_dead():
    links = scripted_server(stopping_server(answer_requests=False), dead_after=600.0)
    pending = links.submit("score", [([3], {})], lambda values: values)
    with pytest.raises(ServerDiedError, match="rank 3 is gone.*while it was being closed"):
        links.retire([3], "test", timeout=10)
    with pytest.raises(ServerDiedError):
        pending.result(5)
    links.shutdown(abort=True, reason="test", wait=2)



def test_a_cancelled_call_is_answered_into_the_void_and_the_link_goes_on():
    released = threading.Event()

    def script(link):
        request = messages.receive(link)
        released.wait(10)  # answer only once the client cancelled the call
        messages.send(link, messages.Reply(request.id, 3, value="late"))
        echo_server(link)

    links = scripted_server(script)
    future = links.submit("score", [([3], "first")], lambda values: values[3])
    assert future.cancel()
    released.set()
    assert links.submit("ping", [([3], "next")], lambda values: values[3]).result(5) == "next"
    assert not links.dead  # the late reply to a cancelled future did not stop the reader
    links.shutdown(abort=False, reason="test", wait=2)


def test_a_rank_that_dies_while_a_request_is_encoded_fails_that_request_at_once(monkeypatch):
    links = scripted_server(echo_server)
    encode = frames.encode

    def encode_while_the_rank_dies(*args, **kwargs):  # the reader sees the rank's end in the middle of encoding
        links._mark_dead(3, "its connection closed (simulated)")
        return encode(*args, **kwargs)

    monkeypatch.setattr(frames, "encode", encode_while_the_rank_dies)
    with pytest.raises(ServerDiedError, match="simulated"):
        links.submit("score", [([3], "payload")], lambda values: values[3])
    assert not links._calls  # nothing left waiting for an answer that cannot come
    links.shutdown(abort=True, reason="test", wait=2)


def test_a_message_too_large_for_memory_is_skipped_and_the_next_one_is_read(monkeypatch):
    ours, theirs = socket.socketpair()
    ours.settimeout(10)  # a stream out of step would wait for bytes that never come
    reader, writer = frames.Connection(ours), frames.Connection(theirs)
    import numpy

    # an array travels as a buffer of its own after the body (pickle's out-of-band buffers)
    writer.send({"type": "reply", "id": 1, "rank": 1, "error": None}, {"array": numpy.zeros(1000, dtype=numpy.uint8)})
    writer.send({"type": "heartbeat", "busy_with": None})
    failed = []

    def bytearray_without_room(n=0, *args):  # the first allocation of the 1000-byte buffer fails
        if n == 1000 and not failed:
            failed.append(n)
            raise MemoryError("no room for 1000 bytes (simulated)")
        return bytearray(n, *args)

    monkeypatch.setattr(frames, "bytearray", bytearray_without_room, raising=False)
    with pytest.raises(frames.UndecodableBody, match="simulated"):
        reader.recv()
    assert reader.recv() == ({"type": "heartbeat", "busy_with": None}, None)
    reader.close()
    writer.close()


def test_a_callback_that_waits_for_the_next_reply_of_its_own_rank_is_refused_and_the_reader_goes_on():
    """The future a call returns runs its done-callbacks on the thread reading its rank's replies: a callback that
    waits for a later call to the same rank waited for itself, and that rank's replies stopped for good."""
    go = threading.Event()

    def script(link):
        first, second = messages.receive(link), messages.receive(link)
        go.wait(10)  # both replies go out only once the callback is in place
        for request in (first, second):
            messages.send(link, messages.Reply(request.id, 3, value=request.payload))
        third = messages.receive(link)
        messages.send(link, messages.Reply(third.id, 3, value=third.payload))

    links = scripted_server(script)
    first = links.submit("ping", [([3], 1)], lambda values: values[3])
    second = links.submit("ping", [([3], 2)], lambda values: values[3])
    seen = []

    def callback(_):
        try:
            seen.append(second.result())
        except RuntimeError as err:
            seen.append(err)

    first.add_done_callback(callback)
    go.set()
    assert first.result(10) == 1 and second.result(10) == 2
    assert len(seen) == 1 and "waiting for an unfinished call's future in a done-callback" in str(seen[0])
    assert links.submit("ping", [([3], 3)], lambda values: values[3]).result(10) == 3  # the reader goes on
    links.shutdown(abort=False, reason="test", wait=2)

