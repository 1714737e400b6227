"""An asynchronous training loop run in a live run's client (through :meth:`testkit.live.LiveRun.function`) for the
kill-and-resume test: :class:`llmrl.AsyncRollouts` samples one batch per call on its thread (call ``i`` samples
the prompt ``"Item i:"`` with seed ``i``), the loop trains each batch with ``forward_backward`` and ``optim_step``,
saves a checkpoint with the rollouts' state after step ``save_after`` (once the next batch is in the buffer), and
stops for good in the middle of step ``stop_at`` (after ``forward_backward``, before ``optim_step``) for the test
to kill the run there.

Every trained batch is logged as one JSON line (the step, the call index, the sampled tokens, their policy version
and the loss) to ``log_path``, flushed and synced before the loop goes on; the line ``{"stopped": step}`` says the
loop is now waiting mid-step. :func:`wait_for` (called through ``LiveRun.function``) returns the first entry
holding a key once the loop wrote it: the test waits on that event, not on the file. A resumed run (its config
names the checkpoint) goes on from the saved state.

Test code, never shipped.
"""

from __future__ import annotations

import json
import os
import threading

_written: list[dict] = []  # every entry the loop wrote in this process, in order
_changed = threading.Condition()


def start(caller, log_path: str, steps: int, save_after: int, checkpoint: str, stop_at: int | None = None) -> dict:
    """Start the loop on a thread of the client and return at once: the resumed state's step and ``next_call``
    (both 0 on a fresh run)."""
    saved = caller.resumed_client_state()
    thread = threading.Thread(target=_loop, args=(caller, saved, log_path, steps, save_after, checkpoint, stop_at),
                              name="async-resume-loop", daemon=True)
    thread.start()
    return {"step": saved["step"] if saved else 0, "next_call": saved["rollouts"]["next_call"] if saved else 0}


def wait_for(caller, key: str, timeout: float = 300.0) -> dict:
    """The first entry the loop wrote holding ``key`` (or an ``error``), once it is written."""
    with _changed:
        if not _changed.wait_for(lambda: any(key in e or "error" in e for e in _written), timeout):
            raise TimeoutError(f"the loop wrote no {key!r} entry in {timeout:g} s; it wrote {_written[-3:]}")
        return next(e for e in _written if key in e or "error" in e)


def _write(log, entry: dict) -> None:
    log.write(json.dumps(entry) + "\n")
    log.flush()
    os.fsync(log.fileno())
    with _changed:
        _written.append(entry)
        _changed.notify_all()


def _loop(caller, saved, log_path, steps, save_after, checkpoint, stop_at) -> None:
    from llmrl import AsyncRollouts, completion_datum

    def produce(index: int) -> list:
        prompt = caller.tokenize([f"Item {index}:"])[0]["ids"]
        (group,) = caller.generate([prompt], do_sample=True, max_new_tokens=3, num_return_sequences=2, seed=index)
        return [{"index": index, "prompt": prompt, "samples": group}]

    def version_of(rollout) -> int:
        return min(s["policy_version"] for s in rollout["samples"])

    rollouts = AsyncRollouts(produce, max_staleness=1, capacity=1, indexed=True, version_of=version_of)
    step = 0
    if saved:
        rollouts.load_state_dict(saved["rollouts"])
        step = saved["step"]
    version = caller.generate([[1, 2]], max_new_tokens=1)[0][0]["policy_version"]
    with open(log_path, "a") as log:
        try:
            with rollouts:
                while step < steps:
                    (rollout,) = rollouts.take(1, version).rollouts
                    data = [completion_datum(rollout["prompt"], s["tokens"], weights=1.0) for s in rollout["samples"]]
                    out = caller.forward_backward(data, "cross_entropy")
                    _write(log, {"step": step, "index": rollout["index"], "version": version_of(rollout),
                                 "tokens": [list(map(int, s["tokens"])) for s in rollout["samples"]],
                                 "loss": out["metrics"]["loss:sum"]})
                    if step == stop_at:
                        _write(log, {"stopped": step})
                        threading.Event().wait()  # mid-step: gradients pending, until the test kills the run
                    version = caller.optim_step({"learning_rate": 0.05})["policy_version"]
                    step += 1
                    if step == save_after + 1:
                        with rollouts._changed:  # the next batch, sampled during this step, in the buffer: the
                            # save holds it (a call in progress would be made again); test code reads the buffer
                            if not rollouts._changed.wait_for(lambda: rollouts._buffer or rollouts._error, 120):
                                raise TimeoutError("the producer made no batch in 120 s")
                        caller.save(checkpoint, client_state={"rollouts": rollouts.state_dict(), "step": step})
            _write(log, {"done": step})
        except BaseException as err:  # noqa: BLE001 - the test reads it from the log
            _write(log, {"error": repr(err)})
