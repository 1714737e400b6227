"""One ``generate`` call for many Tinker sample requests, and the calls of several samplers sent in turn (the same
for the training calls of several training clients: :mod:`llmrl.engine.tinker.shared_training`).

Tinker recipes send one ``asample`` request per prompt (32 at once for 8 groups of 4, more with several turns);
run one by one they would make as many ``generate`` calls, each a batch of one. :class:`CallBatcher` holds
requests that read the same weights with the same sampling parameters (one ``key``: a sampler, for a tenant) for
``window`` seconds (or until ``most`` have come) and sends them as one ``generate`` call, whose prompts the servers
batch together. Batches of other keys that wait with the same ``shared(key)`` (the sampling parameters: other
tenants' samplers), sent by their window or not yet, join that call, up to ``most`` prompts: the servers then run
every tenant's prompts in the same batches, each row on its own adapter (multi-LoRA batching,
:mod:`llmrl.engine.model.row_adapters`). Requests with a seed are sent alone (a call has one seed, and a request's
samples must not depend on its neighbours). A batch refused for its input (a token id outside the vocabulary, ...) is
sent again key by key, then request by request: only the request at fault fails (``split`` says which errors are a
request's own; for training calls, any).

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


class CallBatcher:
    """``submit(key, prompt)`` returns a future of that prompt's samples; ``run(keys, prompts)`` makes one call
    (``keys``: each prompt's key). ``shared(key)``: what batches of other keys must share to join a call (None: each
    call holds one key's batch). ``split(error)``: whether a call of several requests that raised it is sent again
    key by key, then request by request (by default, a refusal of the input)."""

    def __init__(self, run: Callable[[list, list], list], window: float = 0.02, most: int = 256,
                 in_flight: int = 2, shared: Callable[[tuple], object] | None = None,
                 split: Callable[[BaseException], bool] | None = None):
        self._run, self._window, self._most, self._in_flight = run, window, most, in_flight
        self._shared = shared
        self._split = split or _refused_for_input
        self._lock = threading.Lock()
        self._pending: dict[tuple, list[tuple[list[int], Future]]] = {}  # key -> the batch filling up
        # key -> its batches waiting to be sent, in order, each with whether it goes alone (a seeded request)
        self._ready: OrderedDict[tuple, deque] = OrderedDict()
        self._running = 0
        self._ticks = itertools.count()
        self._last_sent: dict[tuple, int] = {}  # key -> when its last call was sent (the turns)

    def submit(self, key: tuple, prompt: list[int], alone: bool = False) -> Future:
        future: Future = Future()
        if alone:
            self._enqueue(key, [(prompt, future)], alone=True)
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

    def _enqueue(self, key: tuple, batch: list, alone: bool = False) -> None:
        with self._lock:
            self._ready.setdefault(key, deque()).append((batch, alone))
            self._send_next()

    def _send_next(self) -> None:
        """Start calls while fewer than ``in_flight`` run: each time the batch of the key sent least recently
        (never sent first; between equals, the first to wait), joined by the first batch of each other key that
        shares its ``shared`` part, in the same order, then the batch still filling of each such key (the first
        key's own included) that has no other batch waiting, while the call holds at most ``most`` prompts. Holds
        the lock."""
        while self._running < self._in_flight and self._ready:
            by_turn = sorted(self._ready, key=lambda k: self._last_sent.get(k, -1))  # (stable: the first to wait)
            key = by_turn[0]
            batch, alone = self._take(key)
            parts, size = [(key, batch)], len(batch)
            if self._shared is not None and not alone:
                group = self._shared(key)
                for other in by_turn[1:]:
                    waiting, waiting_alone = self._ready[other][0]
                    if not waiting_alone and size + len(waiting) <= self._most and self._shared(other) == group:
                        parts.append((other, self._take(other)[0]))
                        size += len(waiting)
                for other, filling in list(self._pending.items()):  # batches still in their window join too,
                    if other not in self._ready and size + len(filling) <= self._most \
                            and self._shared(other) == group:  # behind none of their own key's (order kept)
                        del self._pending[other]  # (its window's flush then finds it gone)
                        parts.append((other, filling))
                        size += len(filling)
            tick = next(self._ticks)
            for sent, _ in parts:
                self._last_sent[sent] = tick
            if len(self._last_sent) > REMEMBERED:
                self._last_sent = {k: t for k, t in self._last_sent.items() if k in self._ready or t == tick}
            self._running += 1
            threading.Thread(target=self._send, args=(parts,), daemon=True).start()

    def _take(self, key: tuple) -> tuple[list, bool]:
        """The first batch waiting for ``key`` (and whether it goes alone), off its queue. Holds the lock."""
        batches = self._ready[key]
        taken = batches.popleft()
        if not batches:
            del self._ready[key]
        return taken

    def _send(self, parts: list) -> None:
        try:
            self._call([(key, request) for key, batch in parts for request in batch])
        finally:
            with self._lock:
                self._running -= 1
                self._send_next()

    def _call(self, requests: list) -> None:
        """One call for ``requests`` (each a key and its (prompt, future)); every future gets its prompt's samples,
        or the call's error."""
        try:
            results = self._run([key for key, _ in requests], [prompt for _, (prompt, _) in requests])
        except BaseException as err:  # noqa: BLE001 - every request of the batch gets the error
            if len(requests) > 1 and self._split(err):  # a request's own input: each key's alone, then each
                keys = list(dict.fromkeys(key for key, _ in requests))  # request alone, so that it fails the request
                parts = [[r for r in requests if r[0] == key] for key in keys] if len(keys) > 1 else \
                    [[one] for one in requests]  # that sent it, not its neighbours
                for part in parts:
                    self._call(part)
                return
            for _, (_, future) in requests:
                future.set_exception(err)
            return
        for (_, (_, future)), result in zip(requests, results):
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
