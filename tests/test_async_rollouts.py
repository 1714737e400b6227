"""``llmrl.AsyncRollouts`` against a fake producer whose speed and versions the test drives, with no server.

The fake sampler takes *tickets* from a queue (it blocks until the test hands one: no sleep anywhere). A ticket
says how far behind the learner the sampler's weights were (0: a fast sampler that started after the last step;
k: a slow one that started k steps ago) and how many rollouts it returns; the learner's version is the test's own
counter, moved by one per step. Under a seeded random schedule of fast and slow samplers, the test checks, from
its own record of what was produced and at which version each batch was taken:

- every rollout handed over is within ``max_staleness`` of the learner's version (``stale="drop"``);
- rollouts come oldest first and none is handed over twice; a rollout produced before the last one of a batch and
  never handed over was stale when that batch was taken (so no fresh rollout is dropped), and the counts of
  dropped rollouts agree with the test's;
- with ``stale="keep"`` every rollout is handed over, in order, with its staleness as the test computes it;
- multi-turn rollouts (episodes, groups) take their oldest turn's version;
- an exception in the producer is raised in the learner's thread, and closing leaves no thread behind.
"""

from __future__ import annotations

import queue
import random
import threading

import pytest

from llmrl import AsyncRollouts, Episode, Trajectory
from llmrl.engine.client.async_rollouts import rollout_version


class FakeSampler:
    """Produces ``{"id", "policy_version"}`` rollouts when the test hands it a ticket ``(lag, count)``."""

    def __init__(self):
        self.version = 0  # the learner's version, as the test moves it
        self.tickets: queue.Queue = queue.Queue()
        self.produced: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self) -> list[dict]:
        ticket = self.tickets.get()
        if ticket is None:  # the test is done: every later call returns at once too (close() never waits on one)
            self.tickets.put(None)
            return []
        if isinstance(ticket, BaseException):
            raise ticket
        lag, count = ticket
        with self.lock:
            made = [{"id": len(self.produced) + k, "policy_version": max(0, self.version - lag)}
                    for k in range(count)]
            self.produced += made
        return made


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batches_stay_within_the_staleness_bound_under_a_random_schedule_of_slow_and_fast_samplers(seed):
    rng = random.Random(seed)
    sampler, bound, n = FakeSampler(), rng.choice([0, 1, 2]), 4
    taken: list[tuple[int, dict]] = []  # (learner version at the take, rollout)
    dropped_by_test, skipped = 0, set()
    with AsyncRollouts(sampler, max_staleness=bound, capacity=rng.choice([3, 8, 32])) as rollouts:
        for _ in range(25):
            for _ in range(rng.randrange(0, 4)):  # extra samplers, many of them slow
                sampler.tickets.put((rng.choice([0, 0, 1, 2, 3, 5]), rng.randrange(1, 4)))
            for _ in range(n):  # and enough fast ones for the batch to fill
                sampler.tickets.put((rng.randrange(0, bound + 1), 1))
            version = sampler.version
            batch = rollouts.take(n, version)
            assert len(batch) == n
            assert all(version - r["policy_version"] <= bound for r in batch.rollouts)
            assert batch.versions == [r["policy_version"] for r in batch.rollouts]
            assert batch.staleness == [version - r["policy_version"] for r in batch.rollouts]
            assert batch.stats["staleness_max"] == max(batch.staleness)
            # what was skipped on the way was stale now; nothing fresh is dropped
            last = batch.rollouts[-1]["id"]
            handed = {r["id"] for _, r in taken} | {r["id"] for r in batch.rollouts}
            earlier_skipped = {r["id"] for r in sampler.produced[:last] if r["id"] not in handed}
            new_skips = earlier_skipped - skipped
            assert all(version - sampler.produced[i]["policy_version"] > bound for i in new_skips)
            assert batch.dropped == len(new_skips)
            dropped_by_test += len(new_skips)
            skipped = earlier_skipped
            taken += [(version, r) for r in batch.rollouts]
            with sampler.lock:
                sampler.version += 1  # the learner's optimizer step
        ids = [r["id"] for _, r in taken]
        assert ids == sorted(ids) and len(set(ids)) == len(ids), "oldest first, none twice"
        stats = rollouts.stats()
        assert stats["taken"] == len(taken) == 25 * n
        assert stats["dropped_stale"] == dropped_by_test
        assert stats["produced"] == stats["taken"] + stats["dropped_stale"] + stats["buffered"]
        sampler.tickets.put(None)
    assert not threads_named("llmrl-rollouts")


def test_keep_hands_over_stale_rollouts_in_order_with_their_staleness():
    sampler = FakeSampler()
    with AsyncRollouts(sampler, max_staleness=0, stale="keep") as rollouts:
        sampler.version = 3
        for lag in (2, 0, 1):
            sampler.tickets.put((lag, 1))
        batch = rollouts.take(3, 3)
        assert [r["policy_version"] for r in batch.rollouts] == [1, 3, 2]
        assert batch.staleness == [2, 0, 1] and batch.dropped == 0
        assert batch.stats["staleness_mean"] == 1.0
        assert rollouts.stats()["kept_stale"] == 2
        sampler.tickets.put(None)
    assert not threads_named("llmrl-rollouts")


def test_a_producer_exception_is_raised_in_the_learners_thread_and_no_thread_is_left():
    sampler = FakeSampler()
    rollouts = AsyncRollouts(sampler, max_staleness=1).start()
    sampler.tickets.put((0, 2))
    assert len(rollouts.take(2, 0)) == 2
    sampler.tickets.put(KeyError("the environment broke"))
    with pytest.raises(KeyError, match="the environment broke"):
        rollouts.take(1, 0)
    rollouts.close()  # already raised: closing does not raise it twice
    assert not threads_named("llmrl-rollouts")


def test_close_raises_a_producer_exception_the_learner_has_not_seen():
    sampler = FakeSampler()
    rollouts = AsyncRollouts(sampler, max_staleness=1).start()
    sampler.tickets.put(ValueError("lost?"))
    with pytest.raises(ValueError, match="lost"):
        rollouts.close()
    assert not threads_named("llmrl-rollouts")


def test_close_stops_a_producer_waiting_for_room_and_take_after_close_says_so():
    sampler = FakeSampler()
    rollouts = AsyncRollouts(sampler, max_staleness=0, capacity=1).start()
    sampler.tickets.put((0, 3))  # three rollouts for a buffer of one: the producer waits for room
    assert rollouts.take(1, 0).rollouts[0]["id"] == 0
    rollouts.close()
    assert not threads_named("llmrl-rollouts")
    with pytest.raises(RuntimeError, match="closed"):
        rollouts.take(1, 0)


class Ids:
    all_special_ids = [0]
    eos_token_id = 0
    added_tokens_decoder: dict = {}


def test_an_episode_or_a_group_is_as_old_as_its_oldest_turn():
    trajectory = Trajectory(Ids(), [5])
    for tokens, version in (([7], 6), ([8], 4), ([9], 5)):
        trajectory.add_sample({"tokens": tokens, "logprobs": [-1.0], "policy_version": version})
    episode = Episode(trajectory)
    assert rollout_version(episode) == 4
    assert rollout_version([{"policy_version": 7}, episode]) == 4
    with pytest.raises(ValueError, match="carries no policy_version"):
        rollout_version({"tokens": [1]})


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncRollouts(list, max_staleness=-1)
    with pytest.raises(ValueError, match="stale must be one of"):
        AsyncRollouts(list, max_staleness=0, stale="reweigh")
    with pytest.raises(RuntimeError, match="start the AsyncRollouts first"):
        AsyncRollouts(list, max_staleness=0).take(1, 0)


class StartedSampler:
    """One learner batch a call: it reads the learner's version when the call starts (the weights it samples from),
    then, unless ``free``, waits for a ticket (sampling takes as long as the test makes it), and returns ``size``
    rollouts of that version, ids ``(call index, k)``."""

    def __init__(self, size: int, free: bool = False):
        self.size, self.free, self.version, self.calls = size, free, 0, 0
        self.tickets: queue.Queue = queue.Queue()
        self.started = threading.Condition()

    def __call__(self, index: int | None = None) -> list[dict]:
        with self.started:
            version, call = self.version, self.calls if index is None else index
            self.calls += 1
            self.started.notify_all()
        if not self.free and self.tickets.get() is None:
            self.tickets.put(None)  # the test is done: every later call returns at once too
            return []
        return [{"id": (call, k), "policy_version": version} for k in range(self.size)]

    def wait_started(self, calls: int) -> None:
        with self.started:
            assert self.started.wait_for(lambda: self.calls >= calls, timeout=120), f"call {calls - 1} never started"


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_a_capacity_of_max_staleness_batches_drops_nothing_when_a_call_makes_one_batch(bound):
    """The call for batch k + K starts only once batch k was taken. The sampler here is as fast as can be, and the
    learner steps only once that call has started (the sampler as far ahead as the bound lets it): every batch is
    still within K steps of the learner, and nothing is dropped."""
    size = 3
    sampler = StartedSampler(size, free=True)
    with AsyncRollouts(sampler, max_staleness=bound, capacity=bound * size) as rollouts:
        for step in range(20):
            batch = rollouts.take(size, sampler.version)
            assert batch.dropped == 0 and max(batch.staleness) <= bound
            assert [r["id"] for r in batch.rollouts] == [(step, k) for k in range(size)]
            sampler.wait_started(step + bound + 1)  # the call for batch step + bound
            with sampler.started:
                sampler.version += 1  # the optimizer step
        assert rollouts.stats()["dropped_stale"] == 0


def test_a_resumed_state_hands_over_every_call_once_from_the_buffer_then_from_the_saved_index():
    """A run saves its state while the producer is between calls (the buffer holds finished ones, a call is in
    progress), is stopped, and a new AsyncRollouts goes on from that state: the rollouts taken before the save and
    after the resume are every call's, once each, in order; those buffered at the save come back unchanged. The
    state goes through the checkpoint's check and a ``torch.save`` / ``torch.load(weights_only=True)`` round trip."""
    import io

    import torch

    from llmrl.engine.client.client_state import check_client_state

    size, first = 2, AsyncRollouts(StartedSampler(2), max_staleness=5, capacity=8, indexed=True)
    sampler = first.produce
    with first:
        for _ in range(7):
            sampler.tickets.put(True)  # 7 calls finish: 3 buffered after the take below, the 8th is in progress
        before = [r["id"] for r in first.take(4 * size, 0).rollouts]  # calls 0-3
        with first._changed:  # observe the producer's state: 3 more calls buffered, the next one in progress
            while len(first._buffer) < 3 * size:
                first._changed.wait()
        state = first.state_dict()
        for _ in range(3):
            sampler.tickets.put(None)
    assert state["next_call"] == 7 and [entry[0] for entry in state["buffer"]] == [4, 4, 5, 5, 6, 6]
    check_client_state(state)
    saved = io.BytesIO()
    torch.save({"rollouts": state}, saved)
    saved.seek(0)
    restored = torch.load(saved, weights_only=True)["rollouts"]

    second_sampler = StartedSampler(size)
    second = AsyncRollouts(second_sampler, max_staleness=5, capacity=6, indexed=True)
    second.load_state_dict(restored)
    with second:
        for _ in range(3):
            second_sampler.tickets.put(True)
        buffered = second.take(3 * size, 0).rollouts
        after = [r["id"] for r in second.take(3 * size, 0).rollouts]
        second_sampler.tickets.put(None)
    assert buffered == [entry[2] for entry in state["buffer"]]
    ids = before + [r["id"] for r in buffered] + after
    assert ids == [(call, k) for call in range(10) for k in range(size)], "every call once, in order"


def test_state_dict_needs_an_indexed_producer_and_load_goes_before_start():
    with pytest.raises(RuntimeError, match="indexed=True"):
        AsyncRollouts(list, max_staleness=0).state_dict()
    rollouts = AsyncRollouts(StartedSampler(1), max_staleness=0, indexed=True)
    with pytest.raises(ValueError, match="not an AsyncRollouts state"):
        rollouts.load_state_dict({"buffer": []})
    with pytest.raises(ValueError, match=r"state\['next_call'\] must be a int"):
        rollouts.load_state_dict({"format": 1, "buffer": [], "counts": {}})
    with pytest.raises(ValueError, match=r"state\['buffer'\]\[1\] must be \[call index, version, rollout\]"):
        rollouts.load_state_dict({"format": 1, "next_call": 2, "counts": {}, "buffer": [[0, 0, "a"], [1, "x", "b"]]})
    assert rollouts.stats()["buffered"] == 0  # nothing was taken from a bad state
    rollouts.start()
    with pytest.raises(RuntimeError, match="before start"):
        rollouts.load_state_dict(rollouts.state_dict())
    rollouts.produce.tickets.put(None)
    rollouts.close()


def test_a_client_state_that_is_not_plain_data_is_refused_naming_where():
    import torch

    from llmrl.engine.client.client_state import check_client_state
    from llmrl.engine.errors import InvalidArgument

    check_client_state({"cursor": 3, "buffer": [[0, 1, {"tokens": torch.tensor([1, 2]), "text": "a"}]], "x": None})
    with pytest.raises(InvalidArgument, match=r"client_state\['buffer'\]\[0\]\[2\] is a Episode"):
        check_client_state({"buffer": [[0, 1, Episode(Trajectory(Ids(), [5]))]]})
    with pytest.raises(InvalidArgument, match="a key of type object"):
        check_client_state({object(): 1})
    # subclasses that torch.save writes but torch.load(weights_only=True) refuses: refused before the save
    import collections

    import numpy

    Point = collections.namedtuple("Point", "x y")
    for value, name in ((Point(1, 2), "Point"), (collections.defaultdict(int), "defaultdict"),
                        (numpy.float64(0.5), "float64")):
        with pytest.raises(InvalidArgument, match=rf"client_state\['v'\] is a {name}"):
            check_client_state({"v": value})
