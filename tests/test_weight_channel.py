"""``sync_weights(via="group")``'s channel (:mod:`llmrl.engine.model.weight_channel`) on its own: a source leader
and the ranks of a target, as ``WeightChannels`` on threads of this process sharing one TCPStore.

What the targets receive equals what was staged, byte for byte, for every dtype; syncs arrive in order; bytes
that do not match the digest the client relays are refused and the next sync arrives whole; each target rank takes
a sync in its own time; a send whose write never came is discarded by the next one; an announcement of another
size is refused before anything is allocated, and ends that group (the next sync forms a new one); a sampler rank
busy for longer than the timeout still gets its send."""

from __future__ import annotations

import dataclasses
import datetime
import threading

import pytest
import torch
from torch.distributed import TCPStore

from llmrl.engine.model import weight_channel
from llmrl.engine.model.weight_channel import WeightChannels, digest, pack, unpack


@pytest.fixture()
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))


@pytest.fixture()
def channels(store):
    """``channels(llm, group_rank)``: a new rank's WeightChannels, closed after the test."""
    made = []

    def make(llm: str, rank: int) -> WeightChannels:
        made.append(WeightChannels(store, llm, rank, timeout=60))
        return made[-1]

    yield make
    for one in made:
        one.close()


def weights(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {"a.lora_A.weight": torch.randn(4, 8, generator=g), "a.lora_B.weight": torch.randn(8, 4, generator=g),
            "half": torch.randn(3, 5, generator=g).to(torch.bfloat16), "count": torch.tensor(7 + k),
            "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3), "mask": torch.tensor([True, False, True])}


def receive_on(channels: list[WeightChannels], staged) -> list:
    """Every target rank's receive, each on its own thread (as each is its own process in a run): the tensors, or
    the exception, per rank."""
    out: list = [None] * len(channels)

    def one(i: int) -> None:
        try:
            out[i] = channels[i].receive(staged)
        except Exception as err:  # the test looks at it
            out[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(channels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert torch.equal(got[name], value), name


def test_pack_and_unpack_keep_every_dtype_and_shape_byte_for_byte():
    w = weights(0)
    buffer, layout = pack(w)
    assert buffer.dtype == torch.uint8 and buffer.numel() >= sum(v.numel() * v.element_size() for v in w.values())
    assert_same(unpack(buffer, layout), w)
    flipped = buffer.clone()
    flipped[3] ^= 1
    assert digest(flipped) != digest(buffer) and digest(buffer.clone()) == digest(buffer)
    assert len(weight_channel.chunks(torch.zeros(2 * weight_channel.CHUNK + 1, dtype=torch.uint8))) == 3


def test_syncs_reach_every_target_rank_in_order_and_bytes_off_the_digest_are_refused(channels, monkeypatch):
    monkeypatch.setattr(weight_channel, "CHUNK", 96)  # several chunks a sync
    source = channels("learner", 0)
    targets = [channels("sampler", rank) for rank in range(2)]
    for k in range(3):
        staged = source.stage("sampler", 2, weights(k))
        assert (staged.generation, staged.sequence) == (1, k + 1)
        for got in receive_on(targets, staged):
            assert_same(got, weights(k))
    forged = dataclasses.replace(source.stage("sampler", 2, weights(5)), digest="0" * 64)
    for got in receive_on(targets, forged):
        assert isinstance(got, ValueError) and "do not match the digest" in str(got)
    staged = source.stage("sampler", 2, weights(6))
    for got in receive_on(targets, staged):  # the refused send did not unpair the group
        assert_same(got, weights(6))
    staged = source.stage("sampler", 2, weights(7))
    assert_same(receive_on(targets[:1], staged)[0], weights(7))  # one rank takes it while the other is busy
    assert_same(receive_on(targets[1:], staged)[0], weights(7))


def test_a_send_whose_write_never_came_is_discarded_by_the_next_sync(channels):
    source, target = channels("learner", 0), channels("sampler", 0)
    source.stage("sampler", 1, weights(0))  # the client gave up before sending its write
    source.stage("sampler", 1, weights(1))  # (and this one's)
    staged = source.stage("sampler", 1, weights(2))
    assert_same(receive_on([target], staged)[0], weights(2))
    staged = source.stage("sampler", 1, weights(3))
    assert_same(receive_on([target], staged)[0], weights(3))


def test_an_announcement_that_does_not_match_the_send_is_refused_before_anything_is_allocated(channels):
    source, target = channels("learner", 0), channels("sampler", 0)
    staged = source.stage("sampler", 1, weights(0))
    bloated = dataclasses.replace(staged, nbytes=2**40)
    got = receive_on([target], bloated)[0]
    assert isinstance(got, ValueError) and f"of {staged.nbytes} bytes where #1 of {2**40}" in str(got)
    late = dataclasses.replace(staged, sequence=2)  # a sync of the closed group is refused at once
    assert "failed on this rank" in str(receive_on([target], late)[0])
    staged = source.stage("sampler", 1, weights(1))
    assert (staged.generation, staged.sequence) == (2, 1)
    assert_same(receive_on([target], staged)[0], weights(1))


def test_a_sampler_rank_busy_for_longer_than_the_timeout_still_gets_the_send(store):
    """The sender forms its group and sends only once the target rank is in the write: no collective waits on
    the sampler's other requests, whatever they take."""
    source, target = WeightChannels(store, "learner", 0, timeout=1), WeightChannels(store, "sampler", 0, timeout=60)
    try:
        staged = source.stage("sampler", 1, weights(0))
        sender = source._targets["sampler"].senders[0]
        sender.waited.wait()  # a wait for the target rank outlasted the 1 s timeout
        assert_same(receive_on([target], staged)[0], weights(0))
        assert sender.failed is None
    finally:
        source.close()
        target.close()
