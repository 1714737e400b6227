"""The future of a call to the servers (what every ``*_async`` method returns): a
:class:`concurrent.futures.Future` that refuses to be waited for on a thread that reads the servers' replies.

Done-callbacks run on those reader threads. A callback that waits for another call's unfinished future (say
``f1.add_done_callback(lambda f: f2.result())``) would wait for the very thread it runs on when ``f2``'s reply
comes from the same rank: that rank's replies would stop for good, with nothing said. So ``result()`` and
``exception()`` of an unfinished future raise there at once, naming the remedy; on every other thread, and for a
finished future, they are ``Future``'s own. This module holds no connection and sends nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

READER_PREFIX = "llmrl-read-"  # the name of every thread that reads a rank's replies


def on_reader_thread() -> bool:
    """Whether this is a thread that reads a rank's replies (and so runs the done-callbacks of their futures)."""
    return threading.current_thread().name.startswith(READER_PREFIX)


class CallFuture(Future):
    """A call's future; see the module."""

    def result(self, timeout: float | None = None):
        self._refuse_waiting_on_a_reader()
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self._refuse_waiting_on_a_reader()
        return super().exception(timeout)

    def _refuse_waiting_on_a_reader(self) -> None:
        if not self.done() and on_reader_thread():
            raise RuntimeError("waiting for an unfinished call's future in a done-callback: callbacks run on a "
                               "thread that reads the servers' replies, possibly this call's own; hand the work to "
                               "another thread (a queue, an executor), or wait where the callback was added")
