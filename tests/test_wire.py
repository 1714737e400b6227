"""Frames carry a JSON header and a pickled body, with tensors and arrays as raw out-of-band buffers; a body that
cannot be decoded is reported with its header and the stream goes on; sizes are capped; both ends of a
connection authenticate each other with the run's secret."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch

from llmrl.engine.transport import frames, messages


def _pair(max_bytes=frames.DEFAULT_MAX_BYTES):
    a, b = socket.socketpair()
    return frames.Connection(a, max_bytes), frames.Connection(b, max_bytes)


def _roundtrip(message):
    left, right = _pair()
    box = []
    reader = threading.Thread(target=lambda: box.append(messages.receive(right)))
    reader.start()
    messages.send(left, message)
    reader.join(10)
    left.close()
    right.close()
    return box[0]


def test_tensors_and_arrays_roundtrip():
    big = torch.randn(300, 257)
    obj = {"f32": big, "bf16": torch.randn(5, 3).bfloat16(), "i64": torch.arange(7), "empty": torch.zeros(0, 4),
           "strided": big[:, ::3], "np": np.arange(12.0).reshape(3, 4), "text": ["ünï", "ok"], "n": None}
    out = _roundtrip(messages.Request(7, "score", obj))
    assert (out.id, out.kind) == (7, "score")
    out = out.payload
    for key in ("f32", "i64", "empty", "strided"):
        assert torch.equal(out[key], obj[key])
    assert out["bf16"].dtype == torch.bfloat16 and torch.equal(out["bf16"], obj["bf16"])
    assert np.array_equal(out["np"], obj["np"]) and out["text"] == obj["text"] and out["n"] is None


def test_every_message_type_roundtrips():
    error = messages.ErrorInfo("ValueError", "bad", "tb", plugin="p", aborted_by_peer=True)
    for message in (messages.Hello(3, "main", 1, 0, "host", 42), messages.Heartbeat(5), messages.Shutdown("x", True),
                    messages.Reply(9, 3, value=[1, 2]), messages.Reply(9, 3, error=error)):
        assert _roundtrip(message) == message


def test_tensor_bytes_travel_out_of_band():
    prefix, header, payload, *buffers = frames.encode({"type": "request"}, {"x": torch.zeros(1000, 1000)})
    assert memoryview(payload).nbytes < 1000 and sum(memoryview(b).nbytes for b in buffers) == 4_000_000


def explode():
    raise RuntimeError("no such class here")


class Unloadable:
    def __reduce__(self):
        return explode, ()


def test_an_undecodable_body_names_its_message_and_the_stream_goes_on():
    left, right = _pair()
    messages.send(left, messages.Request(4, "generate", {"processor": Unloadable()}))
    messages.send(left, messages.Request(5, "ping", None))
    with pytest.raises(frames.UndecodableBody) as bad:
        messages.receive(right)
    assert bad.value.header == {"type": "request", "id": 4, "kind": "generate"}
    assert "no such class here" in str(bad.value)
    assert messages.receive(right) == messages.Request(5, "ping", None)


def test_frames_over_the_limit_are_refused_on_both_sides():
    left, right = _pair(max_bytes=1 << 20)
    with pytest.raises(frames.FrameTooLarge, match="over the limit"):
        messages.send(left, messages.Request(1, "score", b"x" * (2 << 20)))
    left.sock.sendall(frames.PREFIX.pack(10, 1 << 60, 0))  # a header announcing an absurd size
    with pytest.raises(frames.FrameTooLarge, match="announced a message"):
        right.recv()


def _handshake(server_secret, client_secret, rank=2, wanted=lambda r: True):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    box = []
    thread = threading.Thread(target=lambda: box.append(frames.accept(listener, client_secret, wanted)))
    thread.start()
    try:
        conn = frames.connect(listener.getsockname(), server_secret, rank, timeout=5)
    except frames.AuthenticationError as err:
        conn = err
    thread.join(10)
    listener.close()
    return box[0], conn


def test_both_sides_prove_the_secret_and_the_rank_is_authenticated():
    accepted, conn = _handshake(b"k" * 32, b"k" * 32)
    assert accepted[1] == 2 and isinstance(conn, frames.Connection)
    messages.send(conn, messages.Heartbeat())
    assert messages.receive(accepted[0]) == messages.Heartbeat()
    # A server with the wrong secret is refused by the listener; it learns nothing and sees the refusal.
    accepted, conn = _handshake(b"w" * 32, b"k" * 32)
    assert accepted is None and isinstance(conn, (frames.AuthenticationError, ConnectionError))
    # A rank the listener does not expect is refused even with the right secret.
    accepted, conn = _handshake(b"k" * 32, b"k" * 32, rank=9, wanted=lambda r: r == 2)
    assert accepted is None


def test_a_long_error_is_cut_to_fit_its_header_and_the_link_goes_on():
    """An updater that raises with a long list in its message: the reply (its error in the JSON header) is cut in
    the middle, arrives, and the next message still does (a header over 64 KiB used to end the link)."""
    left, right = _pair()
    for text in ("x" * 200_000, "é" * 50_000):  # 6 bytes of JSON for each non-ASCII character
        error = messages.ErrorInfo("ValueError", f"rewards must be numbers, got {text} (end)", "Traceback\n" + text)
        messages.send(left, messages.Reply(7, 1, error=error))
        got = messages.receive(right)
        assert got.error.message.startswith("rewards must be numbers, got ") and got.error.message.endswith("(end)")
        assert "characters cut" in got.error.message and len(got.error.message) < 24_000
        assert got.error.traceback.startswith("Traceback") and "characters cut" in got.error.traceback
    messages.send(left, messages.Reply(8, 1, value=3))
    assert messages.receive(right).value == 3
    with pytest.raises(frames.FrameTooLarge, match="message header of .* bytes is over"):
        frames.encode({"type": "request", "kind": "x" * 70_000})
