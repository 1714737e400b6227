"""Frames carry Python objects, with tensors and arrays as raw out-of-band buffers."""

from __future__ import annotations

import socket
import threading

import numpy as np
import torch

from llmrl.engine.transport import frames


def _roundtrip(obj):
    a, b = socket.socketpair()
    left, right = frames.Connection(a), frames.Connection(b)
    box = []
    reader = threading.Thread(target=lambda: box.append(right.recv()))
    reader.start()
    left.send(obj)
    reader.join(10)
    left.close()
    right.close()
    return box[0]


def test_tensors_and_arrays_roundtrip():
    big = torch.randn(300, 257)
    obj = {"f32": big, "bf16": torch.randn(5, 3).bfloat16(), "i64": torch.arange(7), "empty": torch.zeros(0, 4),
           "strided": big[:, ::3], "np": np.arange(12.0).reshape(3, 4), "text": ["ünï", "ok"], "n": None}
    out = _roundtrip(obj)
    for key in ("f32", "i64", "empty", "strided"):
        assert torch.equal(out[key], obj[key])
    assert out["bf16"].dtype == torch.bfloat16 and torch.equal(out["bf16"], obj["bf16"])
    assert np.array_equal(out["np"], obj["np"]) and out["text"] == obj["text"] and out["n"] is None


def test_tensor_bytes_travel_out_of_band():
    encoded = frames.encode({"x": torch.zeros(1000, 1000)})
    header, payload, *buffers = encoded
    assert memoryview(payload).nbytes < 1000 and sum(memoryview(b).nbytes for b in buffers) == 4_000_000


def test_connection_with_a_wrong_token_is_refused():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    box = []
    thread = threading.Thread(target=lambda: box.append(frames.accept(listener, b"a" * 32)))
    thread.start()
    conn = frames.connect(listener.getsockname(), b"b" * 32, 3, timeout=5)
    thread.join(10)
    assert box == [None]
    conn.close()
    listener.close()
