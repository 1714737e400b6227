"""Rank 0's links to every server rank: accepting them, watching them, routing replies to calls.

Each server rank connects to rank 0's listener at start-up and then sends a heartbeat every
``timeouts.heartbeat`` seconds. A reader thread per link turns incoming replies into completed
futures. A rank whose connection closes, or that stays silent for ``timeouts.dead_after`` seconds,
is declared dead at once: every call waiting on it fails with :class:`ServerDiedError` naming it,
and every later call fails immediately (a run with a dead rank cannot continue).

This module does not know what a request means; the request kinds (:mod:`llmrl.engine.requests`) build and
assemble them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.errors import RequestError, ServerDiedError
from llmrl.engine.log import logger
from llmrl.engine.transport import frames, messages


@dataclass
class _Call:
    id: int
    kind: str
    expected: frozenset[int]
    assemble: Callable[[dict[int, object]], object]
    future: Future
    replies: dict[int, messages.Reply] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)


class ServerLinks:
    """Connections from the client (rank 0) to the server ranks ``expected_ranks``."""

    def __init__(self, listener, token: bytes, expected_ranks: list[int], heartbeat: float, dead_after: float,
                 describe_rank: Callable[[int], str] = str):
        self._listener = listener
        self._token = token
        self.expected_ranks = list(expected_ranks)
        self._heartbeat = heartbeat
        self._dead_after = dead_after
        self._describe = describe_rank
        self._lock = threading.Condition()
        self._links: dict[int, frames.Connection] = {}
        self.hellos: dict[int, messages.Hello] = {}
        self._last_seen: dict[int, float] = {}
        self._busy_with: dict[int, int | None] = {}
        self.dead: dict[int, str] = {}
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._gone: set[int] = set()
        threading.Thread(target=self._accept_loop, name="llmrl-accept", daemon=True).start()
        threading.Thread(target=self._watchdog_loop, name="llmrl-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ connection management

    def _accept_loop(self) -> None:
        while True:
            try:
                accepted = frames.accept(self._listener, self._token)
            except OSError:
                return  # listener closed
            if accepted is None:
                continue
            link, rank = accepted
            try:
                hello = link.recv()
            except (EOFError, OSError):
                link.close()
                continue
            with self._lock:
                if rank not in self.expected_ranks or rank in self._links or self._closing:
                    link.close()
                    continue
                self._links[rank] = link
                self.hellos[rank] = hello
                self._last_seen[rank] = time.monotonic()
                self._lock.notify_all()
            threading.Thread(target=self._read_loop, args=(rank, link), name=f"llmrl-read-{rank}", daemon=True).start()
            if len(self._links) == len(self.expected_ranks):
                return

    def wait_connected(self, timeout: float, on_progress: Callable[[int, int], None] | None = None) -> None:
        """Block until every server rank has connected; raise if one died or the time ran out."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._links) < len(self.expected_ranks):
                self._raise_if_dead()
                if on_progress:
                    on_progress(len(self._links), len(self.expected_ranks))
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(self.expected_ranks) - set(self._links))
                    raise ServerDiedError(missing[0], f"did not connect within {timeout:.0f} s (timeouts.startup)",
                                          f"missing ranks: {missing}")
                self._lock.wait(min(left, 0.5))
            if on_progress:
                on_progress(len(self._links), len(self.expected_ranks))

    def _read_loop(self, rank: int, link: frames.Connection) -> None:
        while True:
            try:
                message = link.recv()
            except (EOFError, OSError) as err:
                with self._lock:
                    self._gone.add(rank)
                    self._lock.notify_all()
                    if self._closing:
                        return
                self._mark_dead(rank, "its connection closed (the process exited or was killed)", str(err))
                return
            now = time.monotonic()
            if isinstance(message, messages.Heartbeat):
                with self._lock:
                    self._last_seen[rank] = now
                    self._busy_with[rank] = message.busy_with
                continue
            if isinstance(message, messages.Reply):
                self._on_reply(rank, message, now)

    def _on_reply(self, rank: int, reply: messages.Reply, now: float) -> None:
        with self._lock:
            self._last_seen[rank] = now
            call = self._calls.get(reply.id)
            if call is None:
                return  # the caller gave up on it (timeout)
            call.replies[rank] = reply
            if len(call.replies) < len(call.expected):
                return
            del self._calls[reply.id]
        self._complete(call)

    def _complete(self, call: _Call) -> None:
        logger.debug(f"{call.kind} #{call.id} answered by ranks {sorted(call.replies)} in "
                     f"{1000 * (time.perf_counter() - call.started):.1f} ms")
        errors = [(r, call.replies[r].error) for r in sorted(call.replies) if call.replies[r].error is not None]
        if errors:
            # Report the rank that failed first-hand rather than those that stopped because of it.
            rank, info = next(((r, e) for r, e in errors if not e.aborted_by_peer), errors[0])
            err = RequestError(info.message, rank=rank, remote_type=info.type, remote_traceback=info.traceback)
            err.plugin = info.plugin
            call.future.set_exception(err)
            return
        try:
            result = call.assemble({r: rep.value for r, rep in call.replies.items()})
        except BaseException as exc:  # noqa: BLE001 - surfaced through the future
            call.future.set_exception(exc)
            return
        call.future.set_result(result)

    def _watchdog_loop(self) -> None:
        while True:
            time.sleep(min(self._heartbeat, 1.0))
            now = time.monotonic()
            with self._lock:
                if self._closing:
                    return
                silent = [r for r, t in self._last_seen.items()
                          if r not in self.dead and r not in self._gone and now - t > self._dead_after]
            for rank in silent:
                self._mark_dead(rank, f"no heartbeat for {self._dead_after:.0f} s (timeouts.dead_after)")

    def _mark_dead(self, rank: int, reason: str, detail: str = "") -> None:
        with self._lock:
            if rank in self.dead or self._closing:
                return
            self.dead[rank] = reason
            failed = [c for c in self._calls.values() if rank in c.expected]
            for call in failed:
                del self._calls[call.id]
            self._lock.notify_all()
        logger.error(f"server {self._describe(rank)} is gone: {reason}")
        for call in failed:
            call.future.set_exception(ServerDiedError(rank, reason, f"during the {call.kind!r} request"))

    def _raise_if_dead(self) -> None:
        if self.dead:
            rank = min(self.dead)
            raise ServerDiedError(rank, self.dead[rank], self._describe(rank))

    # ------------------------------------------------------------------ calls

    def submit(self, kind: str, parts: list[tuple[list[int], dict]], assemble: Callable[[dict[int, object]], object]
               ) -> Future:
        """Send one request: ``parts`` gives each group of ranks its payload (encoded once per group).

        Returns a future of ``assemble({rank: value})``, or of the first error.
        """
        future: Future = Future()
        with self._lock:
            self._raise_if_dead()
            if self._closing:
                raise RuntimeError("the Caller is closed")
            call_id = next(self._ids)
            expected = frozenset(r for ranks, _ in parts for r in ranks)
            if not expected:
                future.set_result(assemble({}))
                return future
            call = _Call(call_id, kind, expected, assemble, future)
            self._calls[call_id] = call
        try:
            for ranks, payload in parts:
                encoded = frames.encode(messages.Request(call_id, kind, payload))
                for rank in ranks:
                    self._links[rank].send_frames(encoded)
        except OSError as err:
            rank = next((r for r in expected if r not in self.dead), min(expected))
            self._mark_dead(rank, "sending to it failed", str(err))
        return future

    def forget(self, future: Future) -> None:
        """Stop waiting for a call (after a client-side timeout); a late reply is dropped."""
        with self._lock:
            for call_id, call in list(self._calls.items()):
                if call.future is future:
                    del self._calls[call_id]

    def busy_ranks(self, future: Future) -> list[int]:
        with self._lock:
            for call in self._calls.values():
                if call.future is future:
                    return sorted(call.expected - set(call.replies))
        return []

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, abort: bool, reason: str, wait: float = 30.0) -> None:
        """Tell every live server to stop, then wait up to ``wait`` seconds for them to hang up."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            links = dict(self._links)
        for rank, link in links.items():
            if rank in self.dead:
                continue
            try:
                link.send(messages.Shutdown(reason=reason, abort=abort))
            except OSError:
                pass
        deadline = time.monotonic() + wait
        with self._lock:
            while set(links) - self._gone - set(self.dead) and time.monotonic() < deadline:
                self._lock.wait(0.1)
        for link in links.values():
            link.close()
        try:
            self._listener.close()
        except OSError:
            pass
        pending = list(self._calls.values())
        self._calls.clear()
        for call in pending:
            if not call.future.done():
                call.future.set_exception(RuntimeError(f"the Caller closed before the {call.kind!r} request finished"))

    @property
    def closing(self) -> bool:
        return self._closing
