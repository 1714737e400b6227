"""One ``generate`` call for many Tinker sample requests.

Tinker recipes send one ``asample`` request per prompt (32 at once for 8 groups of 4, more with several turns);
run one by one they would make as many ``generate`` calls, each a batch of one. :class:`SampleBatcher` holds
requests that read the same weights with the same sampling parameters for ``window`` seconds (or until ``most`` have
come) and sends them as one ``generate`` call, whose prompts the servers batch together. Requests with a seed are
sent alone (a call has one seed, and a request's samples must not depend on its neighbours). A batch refused for
its input (a token id outside the vocabulary, ...) is sent again request by request: only the request at fault fails.

This module groups and splits; the service maps the results (:mod:`llmrl.engine.tinker.service`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class SampleBatcher:
    """``submit(key, prompt)`` returns a future of that prompt's samples; ``run(key, prompts)`` makes one call."""

    def __init__(self, run: Callable[[tuple, list], list], window: float = 0.02, most: int = 256):
        self._run, self._window, self._most = run, window, most
        self._lock = threading.Lock()
        self._pending: dict[tuple, list[tuple[list[int], Future]]] = {}

    def submit(self, key: tuple, prompt: list[int], alone: bool = False) -> Future:
        future: Future = Future()
        if alone:
            threading.Thread(target=self._call, args=(key, [(prompt, future)]), daemon=True).start()
            return future
        with self._lock:
            batch = self._pending.setdefault(key, [])
            batch.append((prompt, future))
            first, full = len(batch) == 1, len(batch) >= self._most
            if full:
                del self._pending[key]
        if full:
            threading.Thread(target=self._call, args=(key, batch), daemon=True).start()
        elif first:
            threading.Timer(self._window, self._flush, args=(key, batch)).start()
        return future

    def _flush(self, key: tuple, batch: list) -> None:
        with self._lock:
            if self._pending.get(key) is batch:
                del self._pending[key]
            else:
                return  # sent already, full
        self._call(key, batch)

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
