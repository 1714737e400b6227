"""The keys of one authenticated connection: the handshake's proofs, bound to the connection, and the session keys
that sign every frame after it.

The listener (the client, rank 0) sends a random challenge; the connecting server answers with its rank, a nonce
of its own and a proof; the listener answers with its proof. Each proof is an HMAC under the run's secret over
the role, both nonces, the rank and the connection's two endpoints *as the prover sees them* (the connecting
side's address, then the listener's). A relay that forwards the handshake bytes unchanged has to open its own TCP
connection, so the endpoints the two sides see differ and the proofs do not verify: it is refused before any
frame. (So the channel cannot cross a network address translation; llmrl's ranks reach each other directly.)

Both sides then derive one key per direction from the secret and both nonces, and every frame carries an HMAC
under its direction's key over a sequence number and all its bytes (:class:`FrameSigner`), checked before
anything in it is decoded: a changed, replayed, reordered, dropped or injected frame fails the check and ends
the connection. Frames are authenticated, not encrypted: their contents can be read on the wire.

This module computes bytes; the sockets and frames are :mod:`llmrl.engine.transport.frames`.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

NONCE = 32
TAG = 32
RANK = struct.Struct("!I")
SEQUENCE = struct.Struct("!Q")


def endpoints(sock: socket.socket, connecting: bool) -> bytes:
    """The connection's endpoints as this side sees them, connecting side first."""
    here, there = sock.getsockname()[:2], sock.getpeername()[:2]
    first, second = (here, there) if connecting else (there, here)
    return f"{first[0]}|{first[1]}|{second[0]}|{second[1]}".encode()


def proof(secret: bytes, role: bytes, challenge: bytes, nonce: bytes, rank: int, seen: bytes) -> bytes:
    """What ``role`` sends to prove it knows the secret, for this connection."""
    message = b"\0".join([b"llmrl-handshake", role, challenge, nonce, RANK.pack(rank), seen])
    return hmac.new(secret, message, hashlib.sha256).digest()


def session_keys(secret: bytes, challenge: bytes, nonce: bytes, rank: int) -> tuple[bytes, bytes]:
    """``(listener to connector, connector to listener)`` keys of the connection."""
    def key(direction: bytes) -> bytes:
        message = b"\0".join([b"llmrl-session", direction, challenge, nonce, RANK.pack(rank)])
        return hmac.new(secret, message, hashlib.sha256).digest()

    return key(b"listener-to-connector"), key(b"connector-to-listener")


class FrameSigner:
    """Signs (or checks) one direction's frames: an HMAC over the frame's sequence number and bytes."""

    def __init__(self, key: bytes):
        self.key = key
        self.sequence = 0

    def begin(self):
        """A running HMAC for the next frame (feed it every buffer of the frame with ``update``); the sequence
        number moves on once the frame is signed or verified (:meth:`done`), so a read that times out before
        the frame's first byte leaves it where it was."""
        return hmac.new(self.key, SEQUENCE.pack(self.sequence), hashlib.sha256)

    def done(self) -> None:
        self.sequence += 1
