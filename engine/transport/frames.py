"""Messages between the client and the servers: pickle frames over TCP, tensors as raw buffers.

A frame is ``[payload length, buffer count, buffer lengths...] payload buffers...``. The payload is
a protocol-5 pickle; torch tensors and numpy arrays travel out of band as their raw bytes (no copy
into the pickle, no re-encoding). Received tensors are CPU tensors.

Only processes of the same run talk this protocol: a connection starts with the run's secret token,
checked before anything is unpickled. Pickle runs code, so never point it at untrusted peers.

This module knows nothing about requests or models: it moves Python objects.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
import sys
import threading

HEADER = struct.Struct("!QI")
LENGTH = struct.Struct("!Q")
TOKEN_BYTES = 32
HELLO = struct.Struct(f"!{TOKEN_BYTES}sI")
_SMALL = 1 << 16


def _rebuild_tensor(array, dtype_name: str):
    import torch

    tensor = torch.from_numpy(array)
    if dtype_name == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


class _Pickler(pickle.Pickler):
    """Sends torch tensors as numpy arrays, whose bytes protocol 5 passes out of band."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            if tensor.dtype == torch.bfloat16:
                return _rebuild_tensor, (tensor.view(torch.int16).numpy(), "bfloat16")
            return _rebuild_tensor, (tensor.numpy(), str(tensor.dtype))
        return NotImplemented


def encode(obj) -> list:
    """Encode ``obj`` into the list of byte buffers of one frame."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    payload = stream.getbuffer()
    raws = [b.raw() for b in buffers]
    header = HEADER.pack(payload.nbytes, len(raws)) + b"".join(LENGTH.pack(r.nbytes) for r in raws)
    return [header, payload, *raws]


class Connection:
    """One socket carrying frames both ways. ``send`` is thread-safe; ``recv`` has one reader."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small replies must not wait (Nagle)
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, obj) -> None:
        self.send_frames(encode(obj))

    def send_frames(self, frames: list) -> None:
        total = sum(memoryview(f).nbytes for f in frames)
        with self._send_lock:
            if total <= _SMALL:
                self.sock.sendall(b"".join(frames))
            else:
                for frame in frames:
                    self.sock.sendall(frame)

    def recv(self):
        """The next object; raises EOFError when the peer closed the connection."""
        payload_len, count = HEADER.unpack(self._recv_exact(HEADER.size))
        lengths = [LENGTH.unpack(self._recv_exact(LENGTH.size))[0] for _ in range(count)]
        payload = self._recv_exact(payload_len)
        buffers = [self._recv_exact(n) for n in lengths]
        return pickle.loads(payload, buffers=buffers)

    def _recv_exact(self, n: int) -> bytearray:
        data = bytearray(n)
        view = memoryview(data)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("connection closed by the peer")
            got += k
        return data

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(address: tuple[str, int], token: bytes, rank: int, timeout: float) -> Connection:
    """Connect to a listener and introduce ourselves (run token + global rank)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.settimeout(None)
    sock.sendall(HELLO.pack(token, rank))
    return Connection(sock)


def accept(listener: socket.socket, token: bytes) -> tuple[Connection, int] | None:
    """Accept one connection; return it with the peer's rank, or None if its token is wrong."""
    sock, _ = listener.accept()
    sock.settimeout(10.0)
    try:
        hello = bytearray()
        while len(hello) < HELLO.size:
            chunk = sock.recv(HELLO.size - len(hello))
            if not chunk:
                raise OSError("closed during hello")
            hello += chunk
        peer_token, rank = HELLO.unpack(bytes(hello))
    except OSError:
        sock.close()
        return None
    if peer_token != token:
        sock.close()
        return None
    sock.settimeout(None)
    return Connection(sock), rank
