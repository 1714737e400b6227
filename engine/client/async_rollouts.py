"""Sampling while training, on the client: :class:`AsyncRollouts` runs the script's sampling on a background thread
and hands the learner batches whose samples are at most ``max_staleness`` policy versions old.

The script gives a *producer*: a function that makes finished rollouts through the Caller (single-turn ``generate``
samples, groups of them, :class:`~llmrl.engine.client.episodes.Episode` objects of ``run_episodes``...) and returns
them as a list. A background thread calls it again and again and puts what each call returns, whole, in a buffer.
The thread starts a call only while the buffer holds fewer than ``capacity`` rollouts, so it runs at most
``capacity`` rollouts ahead of the learner (plus the call in progress). The learner calls :meth:`take` with the
version of the weights it trains now (``optim_step``'s or ``update``'s ``policy_version``, or its own count of
optimizer steps); a rollout's staleness is that version minus the rollout's (its samples' oldest
``policy_version``, see :func:`rollout_version`). With ``stale="drop"`` a rollout staler than ``max_staleness`` is
dropped and counted; with ``stale="keep"`` it is handed over, with its staleness, for the learner to re-weigh (an
importance ratio against the sampler's log-probs, which every sample carries). Rollouts are handed over oldest
first.

**Nothing dropped.** When each call makes one learner batch and the learner takes one optimizer step per batch,
``capacity = max_staleness`` batches keeps every batch within the bound: the call for batch ``k + K`` starts only
once batch ``k`` was taken, so it samples from weights at most ``K`` steps older than those that train on it.

**Resume.** With ``indexed=True`` the producer is called with the call's index (0, 1, 2, ...) and derives its data
(prompts, seeds) from it. :meth:`state_dict` is then the buffer (each rollout with its call's index and version) and
the index of the first call not finished; ``caller.save(path, client_state={"rollouts": rollouts.state_dict()})``
keeps it in the checkpoint, and a run resumed from it calls :meth:`load_state_dict` before starting. The rollouts
buffered at the save are handed over as they were, the call in progress at the save is made again, and every other
call's rollouts are handed over after the save or before it: none is lost or handed over twice.

:meth:`close` (or leaving the ``with`` block) stops the thread: it waits for the producer call in progress to return
and drops its rollouts. An exception raised by the producer stops the thread and is raised again in the learner's
thread, by the next :meth:`take` or by :meth:`close`: never lost.

This module schedules and filters; it sends nothing itself (the producer does) and does not move weights between
sampler and learner ranks: every request goes to the same servers, which interleave sampling and training requests.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

STALE = ("drop", "keep")
STATE_FORMAT = 1


def rollout_version(rollout) -> int:
    """The policy version of a rollout: a sample's ``policy_version``; the oldest of its turns for an
    :class:`~llmrl.engine.client.episodes.Episode` or a :class:`~llmrl.engine.client.trajectory.Trajectory`; the
    oldest of its members for a list or tuple (a group). Raises ValueError when a sample carries none."""
    if isinstance(rollout, dict):
        if rollout.get("policy_version") is None:
            raise ValueError("a rollout sample carries no policy_version (generate's samples do): give "
                             "AsyncRollouts a version_of function")
        return int(rollout["policy_version"])
    if hasattr(rollout, "trajectory"):
        rollout = rollout.trajectory
    if hasattr(rollout, "policy_versions"):
        versions = rollout.policy_versions
        if not versions or any(v is None for v in versions):
            raise ValueError("a rollout's trajectory has a turn without a policy_version (or no turn): give "
                             "AsyncRollouts a version_of function")
        return min(versions)
    if isinstance(rollout, (list, tuple)) and rollout:
        return min(rollout_version(member) for member in rollout)
    raise ValueError(f"cannot tell the policy version of a {type(rollout).__name__}: give AsyncRollouts a "
                     "version_of function")


@dataclass
class RolloutBatch:
    """What :meth:`AsyncRollouts.take` hands over: the rollouts, oldest first, each one's version and staleness."""

    rollouts: list
    versions: list[int]
    staleness: list[int]
    dropped: int = 0  # rollouts dropped as too stale while this batch was taken
    stats: dict = field(default_factory=dict)  # staleness_mean, staleness_max, dropped_stale

    def __len__(self) -> int:
        return len(self.rollouts)


class AsyncRollouts:
    """Rollouts produced on a background thread, handed to the learner within a staleness bound (see the module).

    Args:
        produce: a function returning a list of finished rollouts, called again and again: of no argument, or of
            the call's index with ``indexed=True``.
        max_staleness: the most versions a handed-over rollout may lag behind the learner's (0: on-policy).
        capacity: a call starts only while the buffer holds fewer rollouts than this.
        stale: ``"drop"`` rollouts staler than ``max_staleness`` (counted), or ``"keep"`` them (their staleness is
            reported for the learner to re-weigh).
        version_of: a rollout's policy version (default: :func:`rollout_version`).
        indexed: call ``produce(index)`` with the call's index (0, 1, 2, ...; a resumed run's go on from its
            checkpoint's), which makes the rollouts resumable (:meth:`state_dict`).

    Example::

        def produce():
            samples = caller.generate(prompts, do_sample=True, max_new_tokens=16)
            return [s for per_prompt in samples for s in per_prompt]

        with llmrl.AsyncRollouts(produce, max_staleness=1) as rollouts:
            version = 0
            for step in range(100):
                batch = rollouts.take(8, version)
                ...  # forward_backward on batch.rollouts, policy_versions=batch.versions
                version = caller.optim_step()["policy_version"]
    """

    def __init__(self, produce: Callable[[], list], *, max_staleness: int, capacity: int = 64, stale: str = "drop",
                 version_of: Callable[[object], int] = rollout_version, indexed: bool = False):
        if not callable(produce):
            raise TypeError(f"produce must be a function returning a list of rollouts, got {type(produce).__name__}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (0: on-policy), got {max_staleness!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if stale not in STALE:
            raise ValueError(f"stale must be one of {STALE}, got {stale!r}")
        self.produce, self.max_staleness, self.capacity, self.stale = produce, max_staleness, capacity, stale
        self.version_of, self.indexed = version_of, bool(indexed)
        self._buffer: deque = deque()  # (version, rollout, call index), in the order they were produced
        self._next_call = 0  # the index of the first call whose rollouts are not in the buffer (nor taken)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._error_raised = False
        self._counts = {"produced": 0, "taken": 0, "dropped_stale": 0, "kept_stale": 0}
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the learner's side

    def start(self) -> AsyncRollouts:
        """Start the producer's thread (``with`` starts it too)."""
        if self._thread is not None:
            raise RuntimeError("these AsyncRollouts were started already")
        self._thread = threading.Thread(target=self._run, name="llmrl-rollouts", daemon=True)
        self._thread.start()
        return self

    def take(self, n: int, version: int) -> RolloutBatch:
        """The ``n`` oldest rollouts within ``max_staleness`` of ``version`` (the learner's policy version now),
        waiting for the producer as needed; staler ones met on the way are dropped (``stale="drop"``). Raises the
        producer's exception as soon as it failed, and RuntimeError once the rollouts are closed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if self._thread is None:
            raise RuntimeError("start the AsyncRollouts first (rollouts.start(), or use them in a with block)")
        taken, versions, dropped = [], [], 0
        with self._changed:
            while len(taken) < n:
                while not self._buffer and self._error is None and not self._stop.is_set():
                    self._changed.wait()
                if self._error is not None or not self._buffer:
                    self._raise_stopped()
                rollout_of, rollout, _ = self._buffer.popleft()
                self._changed.notify_all()  # room for the producer
                if version - rollout_of > self.max_staleness:
                    if self.stale == "drop":
                        dropped += 1
                        self._counts["dropped_stale"] += 1
                        continue
                    self._counts["kept_stale"] += 1
                taken.append(rollout)
                versions.append(rollout_of)
            self._counts["taken"] += n
        staleness = [version - v for v in versions]
        stats = {"staleness_mean": sum(staleness) / n, "staleness_max": float(max(staleness)),
                 "dropped_stale": float(dropped)}
        return RolloutBatch(taken, versions, staleness, dropped, stats)

    def stats(self) -> dict:
        """Counts since the start: ``produced``, ``taken``, ``dropped_stale``, ``kept_stale`` (handed over beyond
        the bound, with ``stale="keep"``) and ``buffered`` (waiting now)."""
        with self._changed:
            return {**self._counts, "buffered": len(self._buffer)}

    def state_dict(self) -> dict:
        """What a checkpoint keeps to resume these rollouts (plain data: for ``caller.save``'s ``client_state``): the
        rollouts buffered now, each with its version and call index, the index of the first call not finished (made
        again on resume) and the counts. Needs ``indexed=True``: the index is the producer's data cursor."""
        if not self.indexed:
            raise RuntimeError("AsyncRollouts.state_dict needs indexed=True: the producer must draw its data from the "
                               "call index for a resumed run to go on where this one stopped")
        with self._changed:
            return {"format": STATE_FORMAT, "next_call": self._next_call, "counts": dict(self._counts),
                    "buffer": [[index, version, rollout] for version, rollout, index in self._buffer]}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a :meth:`state_dict` (before :meth:`start`): its buffered rollouts come first, then the
        producer's calls from its ``next_call``."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict goes before start(): the producer must begin at the saved index")
        if not self.indexed:
            raise RuntimeError("AsyncRollouts.load_state_dict needs indexed=True (see state_dict)")
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not an AsyncRollouts state (format {STATE_FORMAT}): keys "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        for key, kind in (("buffer", list), ("next_call", int), ("counts", dict)):
            if not isinstance(state.get(key), kind):
                raise ValueError(f"AsyncRollouts state[{key!r}] must be a {kind.__name__}, got "
                                 f"{type(state.get(key)).__name__}: pass what state_dict() returned")
        for i, entry in enumerate(state["buffer"]):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in entry[:2]):
                raise ValueError(f"AsyncRollouts state['buffer'][{i}] must be [call index, version, rollout]: pass "
                                 "what state_dict() returned")
        with self._changed:
            self._buffer = deque((version, rollout, index) for index, version, rollout in state["buffer"])
            self._next_call = state["next_call"]
            self._counts.update({key: int(value) for key, value in state["counts"].items() if key in self._counts})

    def close(self) -> None:
        """Stop the producer's thread: wait for its call in progress to return, drop what is buffered, and raise
        the producer's exception if one was not raised yet."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._changed:
            self._buffer.clear()
        if self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error

    def __enter__(self) -> AsyncRollouts:
        return self.start()

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.close()
            return
        try:  # the learner's own error wins; the producer's is chained to it rather than lost
            self.close()
        except Exception as producer_error:  # noqa: BLE001
            error.__context__ = producer_error

    # ------------------------------------------------------------------ the producer's side

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    while len(self._buffer) >= self.capacity and not self._stop.is_set():
                        self._changed.wait()
                    if self._stop.is_set():
                        return
                    index = self._next_call
                made = list(self.produce(index) if self.indexed else self.produce())
                versioned = [(int(self.version_of(rollout)), rollout, index) for rollout in made]
                with self._changed:
                    if self._stop.is_set():
                        return
                    self._buffer.extend(versioned)  # a call's rollouts, whole
                    self._next_call = index + 1
                    self._counts["produced"] += len(versioned)
                    self._changed.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the learner's thread
            with self._changed:
                self._error = err
                self._changed.notify_all()

    def _raise_stopped(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error
        raise RuntimeError("these AsyncRollouts were closed: no rollout will come")
