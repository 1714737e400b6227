"""No hang, no silent wrong answer, no lost data (live runs): calls from many client threads reach the ranks of a
tensor-parallel or lockstep LLM in one order; an input error in one replica's share under ZeRO-3 is an error,
not a hang; arguments the servers cannot decode and results the client cannot decode fail their own call;
NaN update arguments are refused before any step; the run's secret is in no store and strangers are refused;
a frozen server fails a call promptly even when the call is stuck sending to it. After every refusal the
servers keep serving and the next good request returns exactly what it returned before."""

from __future__ import annotations

import os
import re
import signal
import socket

import pytest
import torch

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType, RequestError, ServerDiedError
from llmrl.engine.transport import frames, rendezvous
from testkit import LiveRun

pytestmark = pytest.mark.slow
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "open the door", "x x"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" slowly", " fast"], [" a", " b"]]


@pytest.fixture(scope="module")
def run(tiny):
    config = {"llms": {
        "tp": {"model": tiny["llama"], "tensor_parallel": 2},
        "z3": {"model": tiny["llama"], "replicas": 2, "training": {"zero_stage": 3}},
        "trainable": {"model": tiny["llama"], "replicas": 2, "updater": "llmrl_test_plugins:ChosenScoreUpdater",
                      "training": {"optimizer": {"type": "sgd", "lr": 0.1}, "micro_batch_size": 2}},
    }, "threads_per_rank": 1, "timeouts": {"collective": 30}}
    live = LiveRun(config)
    yield live
    assert live.close() == 0


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("llm", ["tp", "z3"])
def test_calls_from_four_threads_reach_every_rank_in_one_order(run, llm):
    calls = [((CONTEXTS[:k], CANDIDATES[:k]), {"llm": llm}) for k in (1, 2, 4)]  # different shapes per call
    reference = [run.score(*args, **kwargs) for args, kwargs in calls]
    results = run.threads("score", 4, 60, calls)
    for t, rounds in enumerate(results):
        for r, got in enumerate(rounds):
            want = reference[(t + r) % len(calls)]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_an_input_error_in_one_replicas_share_under_zero3_is_an_error_not_a_hang(run):
    reference = run.score(CONTEXTS, CANDIDATES, llm="z3")
    too_long = CONTEXTS[:3] + ["x " * 600]  # only the second replica's share is bad
    one_candidate = CANDIDATES[:3] + [[" a"]]  # (a costly context with several candidates would be cut over both)
    with pytest.raises(RequestError, match="accepts at most 512") as err:
        run.score(too_long, one_candidate, llm="z3", timeout=120)
    assert err.value.rank is not None and err.value.remote_type == "ValueError"
    with pytest.raises(RequestError, match="exceeds the model's maximum length|accepts at most"):
        run.generate(too_long, llm="z3", max_new_tokens=2, timeout=120)
    assert same(run.score(CONTEXTS, CANDIDATES, llm="z3"), reference)  # the replicas are still in step
    sample = run.generate(CONTEXTS, llm="z3", max_new_tokens=3, do_sample=False)
    assert [len(s) for s in sample] == [1] * 4


def test_arguments_the_servers_cannot_decode_fail_their_call(run):
    reference = run.score(CONTEXTS, CANDIDATES, llm="tp")
    with pytest.raises(RequestError, match="cannot decode the 'generate' request"):
        run.with_client_only("generate", "logits_processor", CONTEXTS[:1], llm="tp", max_new_tokens=2)
    assert same(run.score(CONTEXTS, CANDIDATES, llm="tp"), reference)


def test_a_result_the_client_cannot_decode_fails_its_call(run):
    batch = {"actions": [1, 0, 1, 0], "weights": [1.0] * 4}
    with pytest.raises(RequestError, match="cannot decode rank .* result.*cannot be rebuilt here"):
        run.update(CONTEXTS, CANDIDATES, llm="trainable", undecodable_stat=True, **batch)
    stats = run.update(CONTEXTS, CANDIDATES, llm="trainable", **batch)  # the servers go on
    assert [s["optimizer_steps"] for s in stats] == [1, 1]


def test_nan_or_inf_update_arguments_are_refused_before_any_step(run):
    before = run.state_dict(llm="trainable")
    for bad in ([1.0, float("nan"), 1.0, 1.0], torch.tensor([1.0, 1.0, float("inf"), 1.0])):
        with pytest.raises(InvalidArgument, match="'weights' holds (nan|inf) at weights\\[[12]\\]"):
            run.update(CONTEXTS, CANDIDATES, llm="trainable", actions=[1, 0, 1, 0], weights=bad)
    after = run.state_dict(llm="trainable")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_bad_seed_or_minibatch_size_is_refused_naming_it(run):
    """Not rounded (a seed of 1.9), not taken for the default (a minibatch_size of 0), not a raw server error."""
    for kwargs, error, name in (({"seed": 1.9}, InvalidArgumentType, "seed"), ({"seed": True}, InvalidArgumentType,
                                "seed"), ({"minibatch_size": 0}, InvalidArgument, "minibatch_size"),
                                ({"minibatch_size": "2"}, InvalidArgument, "minibatch_size")):
        with pytest.raises(error, match=f"{name} must be"):
            run.generate(["a door"], llm="trainable", max_new_tokens=2, **kwargs)
    with pytest.raises(InvalidArgument, match="minibatch_size must be"):
        run.score(CONTEXTS, CANDIDATES, llm="trainable", minibatch_size=-1)
    assert run.score(CONTEXTS, CANDIDATES, llm="trainable", minibatch_size=1)  # the servers go on


def test_the_secret_is_in_no_store_and_strangers_are_refused(run):
    from torch.distributed import TCPStore

    port = run.master_port
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=30))
    assert not store.check(["llmrl/token"])
    host, listener_port = rendezvous.split_address(store.get(rendezvous.CLIENT_ADDRESS_KEY).decode())
    with pytest.raises(frames.AuthenticationError):
        frames.connect((host, listener_port), os.urandom(32), 1, timeout=10)
    sock = socket.create_connection((host, listener_port), timeout=10)  # a peer that says nothing at all
    sock.recv(frames.NONCE)
    sock.close()
    assert len(run.score(CONTEXTS, CANDIDATES, llm="tp")) == 4
    assert "refused a connection" in run.log


def test_a_frozen_server_fails_a_call_stuck_sending_to_it(tiny):
    live = LiveRun({"llms": {"main": {"model": tiny["llama"], "replicas": 2}}, "threads_per_rank": 1,
                    "timeouts": {"heartbeat": 0.5, "dead_after": 4}})
    try:
        frozen = 2
        pid = live.servers()[frozen]["pid"]
        os.kill(pid, signal.SIGSTOP)  # neither reads nor beats from now on
        huge = ["y" * 20_000] * 2_000  # 40 MB for each replica: far more than the socket buffers hold
        with pytest.raises(ServerDiedError) as err:
            live.score(huge, [[" a"]] * len(huge), timeout=300)
        assert err.value.rank == frozen and "no heartbeat" in str(err.value)
        assert re.search(f"server rank {frozen} .* is gone", live.log)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        live.kill()
