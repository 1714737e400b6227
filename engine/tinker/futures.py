"""The futures of the Tinker service: request ids, their results, long polls, and per-model ordering.

Every Tinker submission is answered at once with a request id; the work runs on a worker thread and its result
(a JSON dict, protobuf bytes, or an error with its category) is kept under that id until the SDK's
``retrieve_future`` fetches it. A poll waits up to ``wait`` seconds for the result (the SDK polls again at once on
"try again", so an immediate answer would make it spin). Requests of one training client run in the order of their
``seq_id`` (:class:`OrderedQueue`): Tinker numbers them, and may send the chunks of one large call out of order; a
request resent with a ``seq_id`` already seen gets the first one's id back. Sampling requests run on a pool of
their own, concurrently.

This module knows nothing of HTTP or of models: it schedules callables and keeps what they return.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

KEEP = 10_000  # results kept at most (the oldest are forgotten first)


@dataclass
class Outcome:
    """What a request came to: ``kind`` is "json", "proto" or "error" (``value``: ``{"error", "category"}``)."""

    kind: str
    value: object


@dataclass
class _Entry:
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None


class Futures:
    """Request ids and their outcomes."""

    def __init__(self, classify: Callable[[BaseException], str], workers: int = 8):
        self._classify = classify  # an exception's error category: "user", "server" or "unknown"
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tinker-request")

    def new(self) -> str:
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._entries[request_id] = _Entry()
            while len(self._entries) > KEEP:
                self._entries.popitem(last=False)
        return request_id

    def run(self, request_id: str, work: Callable[[], Outcome]) -> None:
        """Run ``work`` now, on this thread, and keep what it returns or raises under ``request_id``."""
        try:
            outcome = work()
        except BaseException as err:  # noqa: BLE001 - every failure becomes the request's error
            category = self._classify(err)
            if category != "user":
                traceback.print_exc()
            outcome = Outcome("error", {"error": f"{type(err).__name__}: {err}", "category": category})
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is not None:
            entry.outcome = outcome
            entry.done.set()

    def submit(self, work: Callable[[], Outcome]) -> str:
        """A request id whose ``work`` runs on the pool."""
        request_id = self.new()
        self._pool.submit(self.run, request_id, work)
        return request_id

    def wait(self, request_id: str, wait: float) -> Outcome | None:
        """The outcome, waiting up to ``wait`` seconds; None while pending. KeyError for an unknown id."""
        with self._lock:
            entry = self._entries[request_id]
        entry.done.wait(wait)
        return entry.outcome

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class OrderedQueue:
    """Runs one training client's requests one at a time, in ``seq_id`` order, on a thread of its own. A missing
    ``seq_id`` is waited for ``gap_wait`` seconds, then skipped (the lowest waiting request runs)."""

    def __init__(self, futures: Futures, name: str, gap_wait: float = 10.0):
        self._futures = futures
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[str, Callable[[], Outcome]]] = {}
        self._seen: dict[int, str] = {}
        self._next = 1
        self._gap_wait = gap_wait
        self._thread = threading.Thread(target=self._loop, name=f"tinker-{name}", daemon=True)
        self._thread.start()

    def submit(self, seq_id: int, work: Callable[[], Outcome]) -> str:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:  # the ordering needs ints
            raise ValueError(f"seq_id must be a non-negative integer, got {seq_id!r}")
        with self._cond:
            if seq_id in self._seen:  # the SDK resent a request it had no answer for: the same request
                return self._seen[seq_id]
            request_id = self._futures.new()
            self._seen[seq_id] = request_id
            self._waiting[seq_id] = (request_id, work)
            self._cond.notify_all()
        return request_id

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                deadline = time.monotonic() + self._gap_wait
                while self._next not in self._waiting and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                if self._next not in self._waiting:
                    if not self._waiting:
                        continue
                    self._next = min(self._waiting)
                request_id, work = self._waiting.pop(self._next)
                self._next += 1
            self._futures.run(request_id, work)
