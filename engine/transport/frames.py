"""Frames between the client and the servers over TCP: a JSON header, a pickled body, tensors as raw buffers.

A frame is ``[header length, body length, buffer count, buffer lengths...] header body buffers...``. The
header is a small JSON object that names the message (its type, request id, rank): it is decoded without
running any code, so a body that cannot be decoded (a class the receiver does not have, a corrupt pickle)
becomes an error attributed to its message (:class:`UndecodableBody`) and the connection goes on. The body
is a protocol-5 pickle; torch tensors and numpy arrays travel out of band as their raw bytes (no copy into
the pickle). Received tensors are CPU tensors. A frame larger than the connection's ``max_bytes`` is refused
before it is sent (:class:`FrameTooLarge`) and, announced by a peer, ends the connection (the stream can no
longer be trusted).

Only processes of the same run talk this protocol: :func:`connect` and :func:`accept` authenticate both
sides with an HMAC challenge-response over the run's secret, bound to the connection's endpoints and the
server's rank, and then every frame carries an HMAC under a session key over its sequence number and bytes,
checked before anything in it is decoded (:mod:`llmrl.engine.transport.auth`). Pickle runs code, so a peer
that fails the handshake is dropped, and a frame that fails its check ends the connection (:class:`TamperedFrame`).

This module knows nothing about requests or models: it moves headers and Python objects.
"""

from __future__ import annotations

import hmac
import io
import json
import os
import pickle
import socket
import struct
import sys
import threading
import time

from llmrl.engine.transport import auth

PREFIX = struct.Struct("!IQI")  # header length, body length, buffer count
LENGTH = struct.Struct("!Q")
NONCE = auth.NONCE
RANK = auth.RANK
_SMALL = 1 << 16  # also the most a frame's JSON header may take (messages.to_frame keeps errors under it)
_CHUNK = 1 << 22
DEFAULT_MAX_BYTES = 4 << 30


class FrameTooLarge(Exception):
    """A frame over the connection's size limit (config key ``max_message_bytes``)."""


class UndecodableBody(Exception):
    """A frame arrived whole but its body could not be decoded; ``header`` says which message it was."""

    def __init__(self, header: dict, error: BaseException):
        self.header = header
        self.error = error
        super().__init__(f"{type(error).__name__}: {error}")


class AuthenticationError(ConnectionError):
    """The peer does not know the run's secret."""


class TamperedFrame(Exception):
    """A frame failed its authentication check (changed, replayed, reordered or injected): the stream can no
    longer be trusted, and nothing of the frame was decoded."""


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


def encode(header: dict, body=None) -> list:
    """The byte buffers of one frame: ``header`` (JSON-able) and ``body`` (any picklable object)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > _SMALL:
        raise FrameTooLarge(f"a message header of {len(head)} bytes is over the {_SMALL} bytes a header may take "
                            "(large values travel in the body)")
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(body)
    payload = stream.getbuffer()
    raws = [b.raw() for b in buffers]
    prefix = PREFIX.pack(len(head), payload.nbytes, len(raws)) + b"".join(LENGTH.pack(r.nbytes) for r in raws)
    return [prefix, head, payload, *raws]


def frame_size(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class Connection:
    """One socket carrying frames both ways. ``send`` is thread-safe; ``recv`` has one reader.

    ``last_activity`` is the monotonic time bytes last arrived, even in the middle of a large frame (a peer
    busy sending a long reply is alive). ``keys`` (sending, receiving) come from the handshake, which always
    gives them; a connection without keys (tests over a socket pair) neither signs nor checks."""

    def __init__(self, sock: socket.socket, max_bytes: int = DEFAULT_MAX_BYTES,
                 keys: tuple[bytes, bytes] | None = None):
        self.sock = sock
        self._signer = auth.FrameSigner(keys[0]) if keys else None
        self._checker = auth.FrameSigner(keys[1]) if keys else None
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small replies must not wait (Nagle)
        self.max_bytes = max_bytes
        self._send_lock = threading.Lock()
        self.closed = False
        self.last_activity = time.monotonic()

    def send(self, header: dict, body=None) -> None:
        self.send_frames(encode(header, body))

    def send_frames(self, frames: list) -> None:
        total = frame_size(frames)
        if total > self.max_bytes:
            raise FrameTooLarge(f"a message of {total} bytes is over the limit of {self.max_bytes} bytes "
                                "(max_message_bytes in the config)")
        with self._send_lock:  # signed in the lock: frames go out in the order of their sequence numbers
            if total <= _SMALL:
                self.sock.sendall(b"".join(self.signed(frames)))
                return
            # A large frame is signed piece by piece as it goes out, so the peer checks one piece while the next
            # is signed here.
            mac = self._signer.begin() if self._signer is not None else None
            for frame in frames:
                view = memoryview(frame).cast("B")
                for start in range(0, view.nbytes, _CHUNK):
                    piece = view[start:start + _CHUNK]
                    if mac is not None:
                        mac.update(piece)
                    self.sock.sendall(piece)
            if mac is not None:
                self._signer.done()
                self.sock.sendall(mac.digest())

    def signed(self, frames: list) -> list:
        """The frame's buffers followed by its tag (the next sequence number's); as they are without keys."""
        if self._signer is None:
            return frames
        mac = self._signer.begin()
        for frame in frames:
            mac.update(frame)
        self._signer.done()
        return [*frames, mac.digest()]

    def recv(self) -> tuple[dict, object]:
        """The next ``(header, body)``. Raises EOFError/OSError when the connection is gone, FrameTooLarge for a
        frame over the limit (the connection is unusable then), UndecodableBody when only the body is bad."""
        mac = self._checker.begin() if self._checker is not None else None
        head_len, body_len, count = PREFIX.unpack(self._recv_exact(PREFIX.size, mac))
        lengths = [LENGTH.unpack(self._recv_exact(LENGTH.size, mac))[0] for _ in range(count)]
        total = PREFIX.size + count * LENGTH.size + head_len + body_len + sum(lengths)
        if head_len > _SMALL:
            raise FrameTooLarge(f"the peer announced a message header of {head_len} bytes, over the {_SMALL} bytes "
                                "a header may take")
        if total > self.max_bytes:
            raise FrameTooLarge(f"the peer announced a message of {total} bytes, over the limit of {self.max_bytes} "
                                "bytes (max_message_bytes in the config)")
        head = self._recv_exact(head_len, mac)
        payload, buffers, read = None, [], 0
        try:
            payload = self._recv_exact(body_len, mac)
            read = body_len
            for n in lengths:
                buffers.append(self._recv_exact(n, mac))  # the buffer is allocated before any of its bytes is read
                read += n
        except MemoryError as err:  # skip what is left of this message (not what was read): the next one is intact
            payload = buffers = None
            self._skip(body_len + sum(lengths) - read, mac)
            self._check(mac)
            raise UndecodableBody(self._header(head), err) from err
        self._check(mac)
        header = self._header(head)
        try:
            return header, pickle.loads(payload, buffers=buffers)
        except BaseException as err:  # noqa: BLE001 - any failure to decode is reported for this message only
            if isinstance(err, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # a real Ctrl-C; raised by an object's unpickling on a reader thread, it is the object's
            raise UndecodableBody(header, err) from err

    @staticmethod
    def _header(head: bytearray) -> dict:
        try:
            return json.loads(bytes(head))
        except ValueError as err:
            raise FrameTooLarge(f"the peer sent a header that is not JSON ({err}); the stream is corrupt") from err

    def _check(self, mac) -> None:
        """Read the frame's tag and compare it with ``mac`` (the running HMAC of its bytes), if this link signs."""
        if mac is None:
            return
        tag = bytes(self._recv_exact(auth.TAG))
        if not hmac.compare_digest(tag, mac.digest()):
            raise TamperedFrame(f"frame {self._checker.sequence} failed its authentication check (changed, "
                                "replayed, reordered or injected on the way): the connection is closed")
        self._checker.done()

    def _recv_exact(self, n: int, mac=None) -> bytearray:
        data = bytearray(n)
        view = memoryview(data)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], min(n - got, _CHUNK))
            if k == 0:
                raise EOFError("connection closed by the peer")
            if mac is not None:
                mac.update(view[got:got + k])
            got += k
            self.last_activity = time.monotonic()
        return data

    def _skip(self, n: int, mac=None) -> None:
        """Read and drop ``n`` bytes (a frame that could not be held in memory), keeping the stream in step."""
        scratch = bytearray(min(n, _CHUNK) or 1)
        while n > 0:
            k = self.sock.recv_into(scratch, min(n, len(scratch)))
            if k == 0:
                raise EOFError("connection closed by the peer")
            if mac is not None:
                mac.update(memoryview(scratch)[:k])
            n -= k
            self.last_activity = time.monotonic()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ----------------------------------------------------------------------------- authentication


def _read(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return bytes(data)


def connect(address: tuple[str, int], secret: bytes, rank: int, timeout: float,
            max_bytes: int = DEFAULT_MAX_BYTES) -> Connection:
    """Connect to the client's listener as server ``rank``; both sides prove they know ``secret``."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        seen = auth.endpoints(sock, connecting=True)
        challenge = _read(sock, NONCE)
        mine = os.urandom(NONCE)
        sock.sendall(RANK.pack(rank) + mine + auth.proof(secret, b"server", challenge, mine, rank, seen))
        try:
            proof = _read(sock, auth.TAG)
        except ConnectionError:
            raise AuthenticationError(f"the listener at {address[0]}:{address[1]} refused rank {rank}: it holds "
                                      "another run's secret, does not expect this rank, or is reached through a "
                                      "relay") from None
        if not hmac.compare_digest(proof, auth.proof(secret, b"client", challenge, mine, rank, seen)):
            raise AuthenticationError(f"the listener at {address[0]}:{address[1]} does not know this run's secret, "
                                      "or is reached through a relay")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    to_listener, from_listener = auth.session_keys(secret, challenge, mine, rank)[::-1]
    return Connection(sock, max_bytes, keys=(to_listener, from_listener))


def accept(listener: socket.socket, secret: bytes, rank_wanted, max_bytes: int = DEFAULT_MAX_BYTES,
           timeout: float = 10.0) -> tuple[Connection, int] | None:
    """Accept one connection and authenticate it. ``rank_wanted(rank)`` says whether that (authenticated) rank
    may connect. Returns the connection and the peer's rank, or None if the peer failed the handshake."""
    sock, _ = listener.accept()
    return authenticate(sock, secret, rank_wanted, max_bytes, timeout)


def authenticate(sock: socket.socket, secret: bytes, rank_wanted, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout: float = 10.0) -> tuple[Connection, int] | None:
    """The listener's side of the handshake on an accepted socket (see :func:`accept`)."""
    sock.settimeout(timeout)
    try:
        seen = auth.endpoints(sock, connecting=False)
        challenge = os.urandom(NONCE)
        sock.sendall(challenge)
        answer = _read(sock, RANK.size + NONCE + auth.TAG)
        (rank,) = RANK.unpack(answer[: RANK.size])
        nonce, mac = answer[RANK.size: RANK.size + NONCE], answer[RANK.size + NONCE:]
        expected = auth.proof(secret, b"server", challenge, nonce, rank, seen)
        if not hmac.compare_digest(mac, expected) or not rank_wanted(rank):
            sock.close()
            return None
        sock.sendall(auth.proof(secret, b"client", challenge, nonce, rank, seen))
    except OSError:
        sock.close()
        return None
    sock.settimeout(None)
    return Connection(sock, max_bytes, keys=auth.session_keys(secret, challenge, nonce, rank)), rank
