"""An HTTP server that serves at most a fixed number of connections at once, for the run's network services (the
Tinker service, the OpenAI-compatible endpoint): each connection has a thread of its own, and one more than the cap
is answered 503 (``Retry-After: 1``) and closed on the accepting thread, which never waits for it; so a client that
opens many connections and says nothing holds at most ``max_connections`` threads.

This module caps connections; it routes nothing, reads no request and checks no key (each service's handler does).
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer


class CappedHTTPServer(ThreadingHTTPServer):
    """A threading server of ``handler`` on ``address`` serving at most ``max_connections`` connections at once; one
    more is answered 503 with ``busy_body`` (JSON, in the service's error shape) and closed."""

    daemon_threads = True
    request_queue_size = 128  # connections the kernel holds before they are accepted (an SDK opens many at once)

    def __init__(self, address, handler, max_connections: int, busy_body: bytes):
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self._busy_body = busy_body
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            refuse_busy(request, self._busy_body)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread of its own, which releases the slot
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)  # handles, and reports any error, then closes
        finally:
            self._slots.release()


def refuse_busy(request: socket.socket, body: bytes) -> None:
    """Answer 503 without blocking: what the client sent so far (up to 1 MB) is read and dropped (closing a socket
    with unread bytes would reset the connection before the answer is read)."""
    answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
              b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        request.setblocking(False)
        try:
            for _ in range(16):  # bounded: a client streaming a large body must not hold the accepting thread
                if not request.recv(65536):
                    break
        except BlockingIOError:
            pass
        request.send(answer)
    except OSError:  # gone already, or its buffer full: it is closed without an answer
        pass
