"""One ``generate`` call for many Tinker sample requests, and the calls of several samplers sent in turn.

Tinker recipes send one ``asample`` request per prompt (32 at once for 8 groups of 4, more with several turns);
run one by one they would make as many ``generate`` calls, each a batch of one. :class:`SampleBatcher` holds
requests that read the same weights with the same sampling parameters (one ``key``: a sampler, for a tenant) for
``window`` seconds (or until ``most`` have come) and sends them as one ``generate`` call, whose prompts the servers
batch together. Requests with a seed are sent alone (a call has one seed, and a request's samples must not depend
on its neighbours). A batch refused for its input (a token id outside the vocabulary, ...) is sent again request by
request: only the request at fault fails.

Calls are sent in turn, at most ``in_flight`` at once (the service's: its LLM's replicas plus one), the key served
least recently first: a sampler with a
thousand requests waiting (several calls of ``most``) does not hold back another sampler's one request for more
than the calls already sent. (Every ready call sent at once would queue at the servers in the order sent, the
other sampler's last.)

This module groups, orders and splits; the service maps the results (:mod:`llmrl.engine.tinker.service`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future

REMEMBERED = 4096  # keys whose last call is remembered for the turns (beyond, keys with nothing waiting are forgotten)


class SampleBatcher:
    """``submit(key, prompt)`` returns a future of that prompt's samples; ``run(key, prompts)`` makes one call."""

    def __init__(self, run: Callable[[tuple, list], list], window: float = 0.02, most: int = 256,
                 in_flight: int = 2):
        self._run, self._window, self._most, self._in_flight = run, window, most, in_flight
        self._lock = threading.Lock()
        self._pending: dict[tuple, list[tuple[list[int], Future]]] = {}  # key -> the batch filling up
        self._ready: OrderedDict[tuple, deque] = OrderedDict()  # key -> its batches waiting to be sent, in order
        self._running = 0
        self._ticks = itertools.count()
        self._last_sent: dict[tuple, int] = {}  # key -> when its last call was sent (the turns)

    def submit(self, key: tuple, prompt: list[int], alone: bool = False) -> Future:
        future: Future = Future()
        if alone:
            self._enqueue(key, [(prompt, future)])
            return future
        with self._lock:
            batch = self._pending.setdefault(key, [])
            batch.append((prompt, future))
            first, full = len(batch) == 1, len(batch) >= self._most
            if full:
                del self._pending[key]
        if full:
            self._enqueue(key, batch)
        elif first:
            timer = threading.Timer(self._window, self._flush, args=(key, batch))
            timer.daemon = True  # a closing service does not wait for it
            timer.start()
        return future

    def _flush(self, key: tuple, batch: list) -> None:
        with self._lock:
            if self._pending.get(key) is batch:
                del self._pending[key]
            else:
                return  # sent already, full
        self._enqueue(key, batch)

    def _enqueue(self, key: tuple, batch: list) -> None:
        with self._lock:
            self._ready.setdefault(key, deque()).append(batch)
            self._send_next()

    def _send_next(self) -> None:
        """Start calls while fewer than ``in_flight`` run: each time the batch of the key sent least recently
        (never sent first; between equals, the first to wait). Holds the lock."""
        while self._running < self._in_flight and self._ready:
            key = min(self._ready, key=lambda k: self._last_sent.get(k, -1))
            batches = self._ready[key]
            batch = batches.popleft()
            if not batches:
                del self._ready[key]
            self._last_sent[key] = next(self._ticks)
            if len(self._last_sent) > REMEMBERED:
                self._last_sent = {k: t for k, t in self._last_sent.items() if k in self._ready or k == key}
            self._running += 1
            threading.Thread(target=self._send, args=(key, batch), daemon=True).start()

    def _send(self, key: tuple, batch: list) -> None:
        try:
            self._call(key, batch)
        finally:
            with self._lock:
                self._running -= 1
                self._send_next()

    def _call(self, key: tuple, batch: list) -> None:
        try:
            results = self._run(key, [prompt for prompt, _ in batch])
        except BaseException as err:  # noqa: BLE001 - every request of the batch gets the error
            if len(batch) > 1 and _refused_for_input(err):  # a request's own input: each alone,
                for one in batch:  # so that it fails the request that sent it, not its neighbours
                    self._call(key, [one])
                return
            for _, future in batch:
                future.set_exception(err)
            return
        for (_, future), result in zip(batch, results):
            future.set_result(result)


def _refused_for_input(err: BaseException) -> bool:
    """Whether a call was refused for its input, here or by the servers (whose refusals arrive as a
    :class:`~llmrl.engine.errors.RequestError` naming the original type): one of the batch's prompts may be at
    fault, not all."""
    from llmrl.engine.errors import RequestError

    if isinstance(err, (ValueError, TypeError)):
        return True
    return isinstance(err, RequestError) and err.remote_type in ("ValueError", "TypeError", "InvalidArgument",
                                                                 "InvalidArgumentType")
