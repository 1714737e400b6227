"""A call's future refuses to be waited for, unfinished, on a thread that reads the servers' replies (where
done-callbacks run): such a wait could be for the thread itself, and that rank's replies would stop for good (a
review's live run hung there until timeouts.request). Elsewhere, and once finished, it is Future's own."""

import threading

import pytest

from llmrl.engine.client.call_future import READER_PREFIX, CallFuture


def on_thread(name: str, work):
    box = []

    def run():
        try:
            box.append(("ok", work()))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            box.append(("err", err))

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(30)
    assert box, "the thread did not finish"
    return box[0]


@pytest.mark.parametrize("wait", ["result", "exception"])
def test_an_unfinished_future_cannot_be_waited_for_on_a_reader_thread(wait):
    future = CallFuture()
    status, err = on_thread(f"{READER_PREFIX}3", lambda: getattr(future, wait)())
    assert status == "err" and isinstance(err, RuntimeError)
    assert "waiting for an unfinished call's future in a done-callback" in str(err)
    future.set_result(5)  # finished: readable anywhere
    assert on_thread(f"{READER_PREFIX}3", future.result) == ("ok", 5)


def test_elsewhere_a_wait_blocks_until_the_future_is_settled():
    future = CallFuture()
    started = threading.Event()

    def wait():
        started.set()
        return future.result(timeout=30)

    box = []
    thread = threading.Thread(target=lambda: box.append(wait()), name="worker")
    thread.start()
    started.wait(30)
    future.set_result("late")
    thread.join(30)
    assert box == ["late"]


def test_a_callback_that_waits_for_another_unfinished_call_gets_the_error_not_a_hang():
    first, second, seen = CallFuture(), CallFuture(), []

    def callback(done):
        try:
            seen.append(second.result())
        except RuntimeError as err:
            seen.append(err)

    first.add_done_callback(callback)
    on_thread(f"{READER_PREFIX}1", lambda: first.set_result(1))  # the reader settles first; its callback runs there
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    second.set_result(2)
    assert second.result() == 2
