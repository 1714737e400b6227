"""The channel between the client and the servers is authenticated end to end: a relay that forwards a genuine
handshake unchanged is refused; after a good handshake, a frame changed on the way (body or header), replayed,
reordered or injected ends the link with TamperedFrame before anything in it is decoded (a payload that would
run code when unpickled never runs); genuine frames with tensors round-trip exactly."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from llmrl.engine.transport import frames, rendezvous

SECRET = b"s" * 32
UNPICKLED = []


def _record():
    UNPICKLED.append(True)
    return "ran"


class Bomb:
    """Unpickling it runs code (here: records that it ran)."""

    def __reduce__(self):
        return _record, ()


def pair() -> tuple[frames.Connection, frames.Connection]:
    """(server side, client side) of a real, authenticated connection on loopback."""
    listener = rendezvous.listen("127.0.0.1")
    box = []
    thread = threading.Thread(target=lambda: box.append(frames.accept(listener, SECRET, lambda rank: True)))
    thread.start()
    server = frames.connect(listener.getsockname(), SECRET, 1, timeout=5)
    thread.join(10)
    listener.close()
    client, rank = box[0]
    assert rank == 1
    return server, client


def relay_to(target: tuple[str, int]) -> tuple[str, int]:
    """A local relay: every connection it accepts is forwarded byte for byte to ``target``, both ways."""
    listener = rendezvous.listen("127.0.0.1")

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve():
        inbound, _ = listener.accept()
        outbound = socket.create_connection(target)
        threading.Thread(target=pump, args=(inbound, outbound), daemon=True).start()
        threading.Thread(target=pump, args=(outbound, inbound), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()


def test_a_relay_forwarding_a_genuine_handshake_unchanged_is_refused():
    listener = rendezvous.listen("127.0.0.1")
    box = []
    thread = threading.Thread(target=lambda: box.append(frames.accept(listener, SECRET, lambda rank: True)))
    thread.start()
    with pytest.raises(frames.AuthenticationError):
        frames.connect(relay_to(listener.getsockname()), SECRET, 1, timeout=5)
    thread.join(10)
    assert box == [None], "the listener must refuse the relayed handshake"
    listener.close()


def signed_bytes(link: frames.Connection, header: dict, body) -> bytearray:
    return bytearray(b"".join(bytes(memoryview(part)) for part in link.signed(frames.encode(header, body))))


def tampered(receiver: frames.Connection) -> None:
    with pytest.raises(frames.TamperedFrame):
        receiver.recv()
    assert not UNPICKLED, "nothing of a frame that fails its check may be decoded"


@pytest.mark.parametrize("change", ["body", "header", "unsigned", "replayed", "reordered"])
def test_a_frame_changed_replayed_reordered_or_injected_ends_the_link_before_decoding(change):
    UNPICKLED.clear()
    server, client = pair()
    header = {"type": "reply", "id": 7}
    if change == "body":
        data = signed_bytes(server, header, {"x": Bomb(), "n": 1})
        data[-40] ^= 1  # a byte of the pickle, before the 32-byte tag
        server.sock.sendall(data)
    elif change == "header":
        data = signed_bytes(server, header, Bomb())
        start = frames.PREFIX.size
        data[start:start + len(b'{"type":"reply","id":7}')] = b'{"type":"reply","id":8}'
        server.sock.sendall(data)
    elif change == "unsigned":  # injected by someone without the key: a well-formed frame, a made-up tag
        server.sock.sendall(b"".join(bytes(memoryview(p)) for p in frames.encode(header, Bomb())) + b"\0" * 32)
    elif change == "replayed":
        data = signed_bytes(server, header, "first")
        server.sock.sendall(data)
        assert client.recv() == (header, "first")
        server.sock.sendall(data)  # the same bytes again
    else:
        first, second = signed_bytes(server, header, "first"), signed_bytes(server, header, Bomb())
        server.sock.sendall(second + first)
    tampered(client)
    server.close()
    client.close()


def test_genuine_frames_with_tensors_round_trip_exactly_both_ways():
    server, client = pair()
    body = {"t": torch.randn(300, 70), "b": torch.randn(5, 3).bfloat16(), "i": torch.arange(9), "s": "text"}
    for _ in range(3):
        server.send({"type": "reply", "id": 1}, body)
        header, got = client.recv()
        assert header == {"type": "reply", "id": 1}
        assert all(torch.equal(got[k], body[k]) for k in ("t", "b", "i")) and got["s"] == "text"
        client.send({"type": "request", "id": 2}, [body["t"]])
        assert torch.equal(server.recv()[1][0], body["t"])
    server.close()
    client.close()
