"""Rank 0's links to every server rank: accepting them, watching them, routing replies to calls.

Each server rank connects to rank 0's listener at start-up (both sides prove they hold the run's secret before
anything is decoded; one that comes while the client closes is told to stop) and then sends a heartbeat every
``timeouts.heartbeat`` seconds. A reader thread per link turns incoming replies into completed futures; it survives
anything it reads: a reply whose value cannot be decoded fails its own call, a corrupt or oversized frame ends that
link loudly. A rank whose connection closes, or that stays silent for ``timeouts.dead_after`` seconds, is declared
dead at once: its socket is shut (unblocking any send stuck on it), every call waiting on it fails with
:class:`ServerDiedError` naming it, and every later call fails immediately. Silence is measured on bytes received,
so a server busy sending a long reply is alive, and time when the client itself was stalled (a long environment
step holding the interpreter) does not count against the servers.

Calls are sent under one lock, so every rank receives requests in the same order whichever thread sent them: the
ranks of one LLM (tensor-parallel shards, replicas in lockstep) always serve the same request together.

Ranks can also be retired while the others go on (``Caller.close_llm``): they are told to stop after the work already
sent to them, and their hanging up is then an expected end, not a death.

This module does not know what a request means; the request kinds (:mod:`llmrl.engine.requests`) build them.
"""

from __future__ import annotations

import itertools
import select
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from llmrl.engine.client.call_future import READER_PREFIX, CallFuture
from llmrl.engine.errors import InvalidArgument, RequestError, ServerDiedError
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

    def __init__(self, listener, secret: bytes, expected_ranks: list[int], heartbeat: float, dead_after: float,
                 describe_rank: Callable[[int], str] = str, max_bytes: int = frames.DEFAULT_MAX_BYTES):
        self._listener = listener
        self._secret = secret
        self.expected_ranks = list(expected_ranks)
        self._heartbeat = heartbeat
        self._dead_after = dead_after
        self._describe = describe_rank
        self._max_bytes = max_bytes
        self._lock = threading.Condition()
        self._send_order = threading.Lock()
        self._links: dict[int, frames.Connection] = {}
        self.hellos: dict[int, messages.Hello] = {}
        self._grace_until = 0.0  # silence before this time does not count (the client itself was stalled)
        self.dead: dict[int, str] = {}
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._gone: set[int] = set()
        self.retired: set[int] = set()  # stopped on purpose (Caller.close_llm): hanging up is not dying
        self.stuck: list[int] = []  # still connected when shutdown's wait ran out
        threading.Thread(target=self._accept_loop, name="llmrl-accept", daemon=True).start()
        threading.Thread(target=self._watchdog_loop, name="llmrl-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ connection management

    def _rank_wanted(self, rank: int) -> bool:
        with self._lock:
            return rank in self.expected_ranks and rank not in self._links

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            threading.Thread(target=self._admit, args=(sock,), name="llmrl-admit", daemon=True).start()

    def _admit(self, sock) -> None:
        """Authenticate one connection, read its Hello and start its reader (a peer that fails is dropped)."""
        accepted = frames.authenticate(sock, self._secret, self._rank_wanted, self._max_bytes)
        if accepted is None:
            logger.warning("refused a connection that does not know this run's secret (or named a rank "
                           "that is not expected)")
            return
        link, rank = accepted
        try:
            hello = messages.receive(link)
            if not isinstance(hello, messages.Hello) or hello.rank != rank:
                raise ValueError(f"expected a Hello from rank {rank}, got {hello!r}")
        except Exception as err:  # noqa: BLE001 - a bad peer is dropped, whatever it sent
            logger.warning(f"dropped rank {rank}'s connection: {type(err).__name__}: {err}")
            link.close()
            return
        with self._lock:
            if rank in self._links or self._closing:
                if rank not in self._links:  # the script ended before this rank was up: a clean stop (it exits 0)
                    messages.send_quietly(link, messages.Shutdown(reason="the script ended before this rank was up"))
                link.close()
                return
            self._links[rank] = link
            self.hellos[rank] = hello
            self._lock.notify_all()
        threading.Thread(target=self._read_loop, args=(rank, link), name=f"{READER_PREFIX}{rank}", daemon=True).start()

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
        logger.debug(f"all {len(self.expected_ranks)} server ranks connected")

    def _read_loop(self, rank: int, link: frames.Connection) -> None:
        try:
            while True:
                try:
                    message = messages.receive(link)
                except frames.UndecodableBody as bad:
                    self._on_undecodable(rank, bad)
                    continue
                if isinstance(message, messages.Reply):
                    self._on_reply(rank, message)
                elif isinstance(message, messages.Heartbeat):
                    continue
                else:
                    raise ValueError(f"unexpected {type(message).__name__} from a server")
        except (EOFError, OSError) as err:
            with self._lock:
                self._gone.add(rank)
                self._lock.notify_all()
                if self._closing:
                    return
                if rank in self.retired and not any(rank in call.expected for call in self._calls.values()):
                    link.close()  # a retired rank that answered everything sent to it: a clean stop
                    return
            self._mark_dead(rank, "its connection closed (the process exited or was killed)", str(err))
        except BaseException as err:  # noqa: BLE001 - never a silent dead reader: the rank is declared gone, loudly
            logger.error(f"reading from rank {rank} failed:\n{traceback.format_exc()}")
            self._mark_dead(rank, f"it sent something that cannot be read ({type(err).__name__}: {err})")

    def _on_undecodable(self, rank: int, bad: frames.UndecodableBody) -> None:
        header = bad.header
        if header.get("type") != "reply" or not isinstance(header.get("id"), int):
            raise ValueError(f"an undecodable {header.get('type')!r} message: {bad}")
        info = messages.ErrorInfo("UnpicklingError", f"the client cannot decode rank {rank}'s result: {bad} (a "
                                  "result must be built from types the client can import: plain Python, tensors, "
                                  "or classes from installed modules)", "")
        self._on_reply(rank, messages.Reply(header["id"], rank, error=info))

    def _on_reply(self, rank: int, reply: messages.Reply) -> None:
        with self._lock:
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
            _settle(call.future, error=err)
            return
        try:
            result = call.assemble({r: rep.value for r, rep in call.replies.items()})
        except BaseException as exc:  # noqa: BLE001 - surfaced through the future
            _settle(call.future, error=exc)
            return
        _settle(call.future, result)

    def _watchdog_loop(self) -> None:
        interval = min(self._heartbeat, 1.0)
        last_tick = time.monotonic()
        while True:
            time.sleep(interval)
            now = time.monotonic()
            if now - last_tick > interval + max(1.0, self._heartbeat):
                # This process was stalled (the script held the interpreter, the machine swapped): the servers'
                # heartbeats may be waiting unread in the sockets. Their silence is measured from now on.
                self._grace_until = now
            last_tick = now
            with self._lock:
                if self._closing:
                    return
                links = {r: link for r, link in self._links.items() if r not in self.dead and r not in self._gone}
            for rank, link in links.items():
                silent_since = max(link.last_activity, self._grace_until)
                if now - silent_since > self._dead_after and not _has_unread_bytes(link):
                    self._mark_dead(rank, f"no heartbeat for {self._dead_after:.0f} s (timeouts.dead_after)")

    def _mark_dead(self, rank: int, reason: str, detail: str = "") -> None:
        with self._lock:
            if rank in self.dead or self._closing:
                return
            self.dead[rank] = reason
            failed = [c for c in self._calls.values() if rank in c.expected]
            for call in failed:
                del self._calls[call.id]
            link = self._links.get(rank)
            self._lock.notify_all()
        if link is not None:
            link.close()  # a send blocked on this socket (a frozen peer, full buffers) fails at once
        logger.error(f"server {self._describe(rank)} is gone: {reason}")
        for call in failed:
            _settle(call.future, error=ServerDiedError(rank, reason, f"during the {call.kind!r} request"))

    def _raise_if_dead(self) -> None:
        if self.dead:
            rank = min(self.dead)
            raise ServerDiedError(rank, self.dead[rank], self._describe(rank))

    # ------------------------------------------------------------------ calls

    def submit(self, kind: str, parts: list[tuple[list[int], object]],
               assemble: Callable[[dict[int, object]], object]) -> Future:
        """Send one request: ``parts`` gives each group of ranks its payload (encoded once per group).

        Returns a future of ``assemble({rank: value})``, or of the first error. A payload that cannot be encoded
        or is over ``max_message_bytes`` raises here, before anything is sent.
        """
        future: Future = CallFuture()
        expected = frozenset(r for ranks, _ in parts for r in ranks)
        if not expected:
            future.set_result(assemble({}))
            return future
        with self._send_order:
            with self._lock:
                self._raise_if_dead()
                if self._closing:
                    raise RuntimeError("the Caller is closed")
                if expected & self.retired:
                    raise RuntimeError(f"ranks {sorted(expected & self.retired)} were stopped by close_llm()")
                call_id = next(self._ids)
            encoded = []
            for ranks, payload in parts:
                try:
                    frame = frames.encode(*messages.to_frame(messages.Request(call_id, kind, payload)))
                except Exception as err:  # noqa: BLE001 - e.g. a lambda among the arguments
                    raise InvalidArgument(f"the {kind!r} request cannot be sent: {type(err).__name__}: {err} "
                                          "(arguments must be picklable)") from err
                size = frames.frame_size(frame)
                if size > self._max_bytes:
                    raise InvalidArgument(f"the {kind!r} request is {size} bytes, over max_message_bytes "
                                          f"({self._max_bytes}); send less per call or raise the limit in the config")
                encoded.append((ranks, frame))
            with self._lock:  # a rank that died while the payload was encoded fails the call here, not never
                self._raise_if_dead()
                if self._closing:
                    raise RuntimeError("the Caller is closed")
                self._calls[call_id] = _Call(call_id, kind, expected, assemble, future)
            for ranks, frame in encoded:
                for rank in ranks:
                    try:
                        self._links[rank].send_frames(frame)
                    except OSError as err:
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

    def retire(self, ranks: list[int], reason: str, timeout: float | None) -> None:
        """Stop ``ranks`` cleanly while the other ranks go on serving, and wait until they have hung up.

        The stop is sent in call order, so the requests already sent to them are answered first. Until they hang
        up they are watched as before (a retiring rank that goes silent or dies is dead); afterwards their end is
        expected. Raises ``ServerDiedError`` if one of them dies instead, ``TimeoutError`` after ``timeout``.
        """
        with self._send_order:
            with self._lock:
                self._raise_if_dead()
                if self._closing:
                    raise RuntimeError("the Caller is closed")
                self.retired.update(ranks)
            for rank in ranks:
                try:
                    messages.send(self._links[rank], messages.Shutdown(reason=reason, abort=False))
                except OSError as err:
                    self._mark_dead(rank, "sending to it failed", str(err))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                dead = sorted(r for r in ranks if r in self.dead)
                if dead:
                    raise ServerDiedError(dead[0], self.dead[dead[0]], "while it was being closed")
                if set(ranks) <= self._gone:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"ranks {sorted(set(ranks) - self._gone)} did not stop within {timeout:g} s")
                self._lock.wait(0.5 if left is None else min(left, 0.5))
        logger.debug(f"ranks {sorted(ranks)} stopped ({reason})")

    def shutdown(self, abort: bool, reason: str, wait: float = 30.0) -> None:
        """Tell every live server to stop, then wait up to ``wait`` seconds for them to hang up."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            links = dict(self._links)
        for rank, link in links.items():
            if rank in self.dead or rank in self._gone:
                continue
            try:
                messages.send(link, messages.Shutdown(reason=reason, abort=abort))
            except OSError:
                pass
        deadline = time.monotonic() + wait
        with self._lock:
            while set(links) - self._gone - set(self.dead) and time.monotonic() < deadline:
                self._lock.wait(0.1)
            self.stuck = sorted(set(links) - self._gone - set(self.dead))
        if self.stuck:  # hanging up on them ends a busy one (serve.py); `llmrl run` kills a frozen one
            logger.error(f"server(s) {', '.join(map(self._describe, self.stuck))} did not stop within {wait:g} s of "
                         f"the stop ({reason}); the client hangs up on them and the run ends with an error")
        for link in links.values():
            link.close()
        try:
            self._listener.close()
        except OSError:
            pass
        pending = list(self._calls.values())
        self._calls.clear()
        for call in pending:
            _settle(call.future, error=RuntimeError(f"the Caller closed before the {call.kind!r} request finished"))

    def never_connected(self) -> list[int]:
        """The expected ranks that never connected (the script ended before they were up, or they failed)."""
        with self._lock:
            return sorted(set(self.expected_ranks) - set(self._links) - set(self.dead))

    @property
    def closing(self) -> bool:
        return self._closing


def _settle(future: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` with ``error``, else ``result``; nothing if it is already resolved or was cancelled (a
    caller may cancel the future a ``*_async`` call returned: its late reply, or its rank's death, is then nobody's
    business, and must not stop the thread that delivers it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _has_unread_bytes(link: frames.Connection) -> bool:
    """Whether the peer sent bytes this process has not read yet (then the peer is not silent)."""
    try:
        readable, _, _ = select.select([link.sock], [], [], 0)
        return bool(readable)
    except (OSError, ValueError):
        return False
