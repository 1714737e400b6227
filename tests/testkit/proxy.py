"""A client script that obeys another process: tests drive a live run through it.

Run as the run's script (``... --module llmrl.launch --config C -m testkit.proxy ADDRESS KEY``),
it connects back to the test process, creates a :class:`~llmrl.Caller` with the keyword arguments it
receives, and then executes ``(method, args, kwargs)`` messages on it, sending back results or
exceptions. ``("many", method, calls)`` starts the calls with ``method_async`` all at once and
returns their results in order; ``("threads", method, n, rounds, calls)`` makes the calls from n threads at
once; ``("with_client_only", method, args, kwargs, key)`` passes an object servers cannot decode as ``key``;
``("in_callback", first, then)`` makes the call ``then`` in the done-callback of ``first``'s future;
``("function", "module:attr", args, kwargs)`` calls a test kit function with the Caller first;
``("exit", code)`` ends the script with that code.

Used only by tests (see :class:`testkit.live.LiveRun`).
"""

from __future__ import annotations

import importlib
import pickle
import sys
from multiprocessing.connection import Client


class _Channel:
    """Plain pickles over a multiprocessing connection (torch's shared-memory tensor passing does not work
    between unrelated processes)."""

    def __init__(self, conn):
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


class ClientOnly:
    """A class that exists only in the client's ``__main__`` (this script): servers cannot unpickle it."""


def _threads(caller, method: str, threads: int, rounds: int, calls: list) -> list[list]:
    """``threads`` threads each make ``rounds`` calls, thread t's round r being ``calls[(t + r) % len(calls)]``."""
    import threading

    results = [[None] * rounds for _ in range(threads)]
    errors = []

    def work(t):
        try:
            for r in range(rounds):
                args, kwargs = calls[(t + r) % len(calls)]
                results[t][r] = getattr(caller, method)(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errors.append(err)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return results


def _in_callback(caller, first: tuple, then: tuple):
    """Start ``first`` (method, args, kwargs) with its ``_async`` twin; in its future's done-callback make the call
    ``then``. Returns ``then``'s result, or raises its error."""
    import concurrent.futures

    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def callback(_future):
        method, args, kwargs = then
        try:
            outcome.set_result(getattr(caller, method)(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            outcome.set_exception(err)

    method, args, kwargs = first
    getattr(caller, f"{method}_async")(*args, **kwargs).add_done_callback(callback)
    return outcome.result()


def main() -> int:
    address, key = sys.argv[1], bytes.fromhex(sys.argv[2])
    host, _, port = address.rpartition(":")
    conn = _Channel(Client((host, int(port)), authkey=key))
    from llmrl import Caller

    try:
        caller = Caller(**conn.recv())
    except BaseException as err:  # noqa: BLE001 - sent to the test
        conn.send(("err", err))
        raise
    conn.send(("ok", caller.info))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return 0
        if message[0] == "exit":
            conn.send(("ok", None))
            return int(message[1])
        if message[0] == "raise":
            conn.send(("ok", None))
            raise RuntimeError(message[1])
        try:
            if message[0] == "many":
                _, method, calls = message
                futures = [getattr(caller, f"{method}_async")(*a, **k) for a, k in calls]
                result = [f.result() for f in futures]
            elif message[0] == "threads":
                result = _threads(caller, *message[1:])
            elif message[0] == "in_callback":  # the call made in the done-callback of another call's future
                result = _in_callback(caller, *message[1:])
            elif message[0] == "function":  # a test kit function called with the Caller: ("module:attr", ...)
                _, target, args, kwargs = message
                module, _, attr = target.partition(":")
                result = getattr(importlib.import_module(module), attr)(caller, *args, **kwargs)
            elif message[0] == "with_client_only":  # one keyword argument holds [ClientOnly()]
                _, method, args, kwargs, key = message
                result = getattr(caller, method)(*args, **{**kwargs, key: [ClientOnly()]})
            else:
                _, method, args, kwargs = message
                result = getattr(caller, method)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as err:  # noqa: BLE001 - sent to the test
            try:
                conn.send(("err", err))
            except Exception:  # noqa: BLE001 - an unpicklable error
                conn.send(("err", RuntimeError(f"{type(err).__name__}: {err}")))
        if message[0] == "call" and message[1] == "close":
            return 0


if __name__ == "__main__":
    sys.exit(main())
