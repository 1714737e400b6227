"""What a request may cost the Tinker service before it is refused, in process (no model): a ``forward_backward``
tensor announcing more values than the model has positions is refused before it is densified (a 104-byte body made
rank 0 allocate hundreds of MB), and so is a sample request for more samples than one request may ask; a body
nested 200k deep is a 400, not a 500 the SDK retries; connections that say nothing (half a request line, a body
that stops) are closed after the server's idle timeout, a client without the key keeps no connection, and
connections beyond the cap are answered 503 without a thread each. After each, the server still answers. The
events are observed (the server closing a socket: ``recv`` returns ``b""``), never waited for with a fixed sleep;
the generous bounds only stop a test that would hang."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading
import time
import tracemalloc

import pytest

from llmrl.engine.tinker.http import make_server

KEY = "tml-test"
BOUND = 30.0  # seconds: an upper bound on an event that takes well under one


def start(service=None, **limits):
    server = make_server(service or object(), "127.0.0.1", 0, KEY, **limits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server) -> None:
    server.shutdown()
    server.server_close()


def healthy(server) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=BOUND)
    connection.request("GET", "/api/v1/healthz", headers={"X-API-Key": KEY})
    response = connection.getresponse()
    answer = (response.status, json.loads(response.read()))
    connection.close()
    return answer == (200, {"status": "ok"})


def post(server, route: str, body: bytes) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=BOUND)
    connection.request("POST", f"/api/v1/{route}", body=body, headers={"X-API-Key": KEY})
    response = connection.getresponse()
    answer = (response.status, json.loads(response.read())["detail"])
    connection.close()
    return answer


def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (``recv`` returns ``b""``); a server that keeps
    it open past :data:`BOUND` fails the test with a timeout."""
    sock.settimeout(BOUND)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


@pytest.mark.skipif(importlib.util.find_spec("tinker") is None, reason="the tinker SDK's protobuf schema")
def test_a_sparse_tensor_announcing_more_values_than_the_model_has_positions_is_refused_before_it_is_densified():
    """Before: the 8M-value shape was densified first (32 MB here; 400 MB on rank 0 with its lists), then failed
    as an IndexError, answered 404."""
    import itertools

    from tinker.proto import tinker_public_pb2 as pb

    from llmrl.engine.tinker.futures import Futures
    from llmrl.engine.tinker.service import TinkerService, classify

    service = TinkerService.__new__(TinkerService)
    service.caller, service.llm, service.models, service.positions = None, "main", {}, 64
    service.futures, service._lock, service._ids = Futures(classify), threading.Lock(), itertools.count(1)
    weights = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[8_000_000],
                        sparse_csr=pb.SparseCsr(crow_indices=b"", col_indices=b"", values=b""))
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=bytes(12)))],
                     loss_fn_inputs={"weights": weights})
    body = pb.ForwardBackwardRequest(model_id="s:train:0", loss_fn="cross_entropy", data=[datum]).SerializeToString()
    assert len(body) < 200
    server = start(service)
    tracemalloc.start()
    try:
        status, detail = post(server, "forward_backward", body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert status == 400, detail
        assert "data[0].loss_fn_inputs['weights']" in detail and "64 positions" in detail
        assert peak < 4 << 20, f"{peak} bytes allocated to refuse it"
        too_long = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=bytes(4 * 65)))])
        status, detail = post(server, "forward_backward", pb.ForwardBackwardRequest(
            model_id="s:train:0", loss_fn="cross_entropy", data=[datum, too_long]).SerializeToString())
        assert status == 400 and "data[0]" in detail
        status, detail = post(server, "forward_backward", pb.ForwardBackwardRequest(
            model_id="s:train:0", loss_fn="cross_entropy", data=[too_long]).SerializeToString())
        assert (status, "data[0].model_input holds 65 tokens" in detail) == (400, True), detail
        assert healthy(server)
    finally:
        stop(server)
        service.futures.close()


def test_a_sparse_tensor_whose_indices_do_not_fit_its_shape_is_a_value_error_naming_it():
    """An index out of its shape was an IndexError (a LookupError: answered 404, "unknown model")."""
    pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
    import numpy as np

    from llmrl.engine.tinker.wire import tensor_values

    def sparse(crow, cols, values, shape):
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, sparse_csr=pb.SparseCsr(
            crow_indices=np.asarray(crow, np.int64).tobytes(), col_indices=np.asarray(cols, np.int64).tobytes(),
            values=np.asarray(values, np.float32).tobytes()))

    assert tensor_values(sparse([0, 1, 1], [2], [5.0], [2, 3]), 6) == [0, 0, 5.0, 0, 0, 0]
    for bad in (sparse([0, 1, 1], [3], [5.0], [2, 3]), sparse([0, 2, 1], [0, 1], [5.0, 6.0], [2, 3]),
                sparse([0, 1], [0], [5.0], [2, 3])):
        with pytest.raises(ValueError, match=r"weights: its sparse CSR indices do not describe a \[2, 3\] tensor"):
            tensor_values(bad, 6, "weights")
    with pytest.raises(ValueError, match="weights holds 6 values .*more than the 5 positions"):
        tensor_values(sparse([0, 1, 1], [2], [5.0], [2, 3]), 5, "weights")


@pytest.mark.parametrize("count", [10**6, 0, -3, "2", True])
def test_a_sample_request_for_more_samples_than_the_service_draws_at_once_is_a_400_naming_num_samples(count):
    """Before: a million samples got a million ids on rank 0 before any was drawn (and 0 or -3 were sent on)."""
    import itertools

    from llmrl.engine.tinker.batching import CallBatcher
    from llmrl.engine.tinker.futures import Futures
    from llmrl.engine.tinker.service import MAX_NUM_SAMPLES, Sampler, TinkerService, classify

    class Caller:
        info = {"main": {"max_length": 64}}

        def generate(self, prompts, **kwargs):
            return [[] for _ in prompts]

    service = TinkerService.__new__(TinkerService)
    service.caller, service.llm, service._lock, service._ids = Caller(), "main", threading.Lock(), itertools.count(1)
    service.futures, service.samplers = Futures(classify), {"s": Sampler("s", "default", "tiny")}
    service.batcher = CallBatcher(service._generate)
    server = start(service)
    try:
        body = {"sampling_session_id": "s", "num_samples": count, "sampling_params": {"max_tokens": 2},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}
        status, detail = post(server, "asample", json.dumps(body).encode())
        assert (status, detail) == (400, f"ValueError: num_samples must be an int from 1 to {MAX_NUM_SAMPLES}, got "
                                         f"{count!r}: send several requests for more samples")
        assert healthy(server)
    finally:
        stop(server)
        service.futures.close()


def test_a_body_over_the_services_limit_is_refused_before_it_is_read():
    """Before: a body of up to 1 GB was read, and its dense tensors became lists of eight times its size."""
    from llmrl.engine.tinker.http import MAX_BODY

    server = start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=BOUND) as sock:
            sock.sendall(b"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode()
                         + f"\r\nContent-Length: {100 << 20}\r\n\r\n".encode())
            answer = closed_by_server(sock)  # answered without waiting for the body, then closed
        assert MAX_BODY <= 64 << 20 and answer.startswith(b"HTTP/1.1 413") and b"send fewer datums" in answer
        assert healthy(server)
    finally:
        stop(server)


def test_a_body_nested_200k_deep_is_a_400_not_a_500_the_sdk_retries():
    class Service:
        def create_session(self, body: dict) -> dict:
            return {"session_id": "s"}

    server = start(Service())
    try:
        status, detail = post(server, "create_session", b"[" * 200_000 + b"]" * 200_000)
        assert status == 400 and "nests" in detail
        assert healthy(server)
    finally:
        stop(server)


def test_silent_connections_are_closed_after_the_idle_timeout_and_a_client_without_the_key_keeps_none():
    """Before: 40 connections each holding half a request line stayed open (a thread each) for as long as they
    liked; a body announced and not sent held its thread forever."""
    server = start(idle_timeout=0.5)
    port = server.server_address[1]
    try:
        half_lines = [socket.create_connection(("127.0.0.1", port), timeout=BOUND) for _ in range(5)]
        for sock in half_lines:
            sock.sendall(b"POST /api/v1/create_ses")
        assert all(closed_by_server(sock) == b"" for sock in half_lines)
        with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:  # a body that stops coming
            sock.sendall(b"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode()
                         + b"\r\nContent-Length: 100\r\n\r\n{\"a\": 1")
            assert closed_by_server(sock).startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:  # a kept-alive connection
            sock.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode() + b"\r\n\r\n")
            assert b'{"status": "ok"}' in closed_by_server(sock)  # answered, then closed once silent
        for sock in half_lines:
            sock.close()
        with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:  # no key: closed at once
            sock.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-wrong\r\n\r\n")
            answer = closed_by_server(sock)
            assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer
        assert healthy(server)
    finally:
        stop(server)


def test_connections_beyond_the_cap_are_answered_503_without_a_thread_each():
    """Before: each of 40 idle connections held a thread of rank 0 (12 threads became 51)."""
    server = start(idle_timeout=BOUND, max_connections=4)
    port = server.server_address[1]
    before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", port), timeout=BOUND) for _ in range(40)]  # silent
    try:
        answers = [closed_by_server(sock) for sock in held[4:]]  # the first 4 are accepted (in order) and held
        assert all(answer.startswith(b"HTTP/1.1 503") and b"retry" in answer for answer in answers), answers[0]
        assert threading.active_count() <= before + 4
        for sock in held[:4]:  # slots freed serve the next connections
            sock.close()
        deadline = time.monotonic() + BOUND
        while not healthy(server):  # a 503 until a held connection's thread has read its end (an event, bounded)
            assert time.monotonic() < deadline
        assert threading.active_count() <= before + 4
    finally:
        for sock in held:
            sock.close()
        stop(server)
