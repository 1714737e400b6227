"""Reliability: bad requests and plugin failures are reported with the server's message and rank while the
servers keep serving; a failing updater leaves replicas identical; timeouts; dead servers make the client
raise and every process exit; a failing or interrupted script stops the servers with its exit code; a crash
during save keeps the previous checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from llmrl.engine.errors import InvalidArgument, RequestError, RequestTimeoutError, ServerDiedError
from testkit import LiveRun

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "open the door", "x x"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" slowly", " fast"], [" a", " b"]]


def trainable(tiny, **extra):
    config = {"model": tiny["llama"], "replicas": 2,
              "updater": "llmrl_test_plugins:ChosenScoreUpdater",
              "training": {"zero_stage": 2, "optimizer": {"type": "sgd", "lr": 0.1}, "micro_batch_size": 2,
                           "gradient_accumulation_steps": 2}}
    config.update(extra)
    return config


@pytest.fixture(scope="module")
def run(tiny):
    config = {"llms": {
        "main": {"model": tiny["llama"], "replicas": 2,
                 "heads": {"value": "value", "broken": "llmrl_test_plugins:BrokenHead",
                           "exiting": "llmrl_test_plugins:ExitingHead",
                           "slow": {"plugin": "llmrl_test_plugins:SlowHead", "args": {"seconds": 4}}},
                 "initializers": [{"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}]},
        "trainable": trainable(tiny),
        "sharded": {"model": tiny["llama"], "replicas": 2, "training": {"zero_stage": 3, "zero3_gather_mb": 0},
                    "initializers": [{"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}]},
    }, "threads_per_rank": 1, "timeouts": {"request": 2.5, "collective": 6}}
    live = LiveRun(config)
    yield live
    assert live.close() == 0


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_bad_requests_are_refused_and_the_servers_keep_serving(run):
    reference = run.score(CONTEXTS, CANDIDATES)
    bad = [
        (lambda: run.score(CONTEXTS, CANDIDATES[:2]), ValueError, "got 4 contexts but 2 candidate lists"),
        (lambda: run.score("one string", [[" a"]]), TypeError, "contexts must be a list of strings"),
        (lambda: run.score([1, 2], [[], []]), TypeError, "contexts\\[0\\] must be a string"),
        (lambda: run.score(CONTEXTS, CANDIDATES, llm="mian"), ValueError, "unknown llm 'mian'"),
        (lambda: run.custom_module_fns(["valeu"], CONTEXTS), RequestError, "unknown head\\(s\\) \\['valeu'\\]"),
        (lambda: run.score(CONTEXTS, CANDIDATES, peft_adapter="c"), RequestError, "unknown peft_adapter 'c'"),
        (lambda: run.score(["x " * 600], [[" a"]]), RequestError, "accepts at most 512"),
        (lambda: run.generate(["a"], max_new_tokens=2, no_such_argument=1), RequestError, "no_such_argument"),
        (lambda: run.generate(["a"], output_logits=False), RequestError, "set by llmrl itself"),
    ]
    for call, kind, words in bad:
        with pytest.raises(kind, match=words) as err:
            call()
        if kind is RequestError:
            assert err.value.rank in (1, 2) and err.value.remote_traceback
        assert same(run.score(CONTEXTS, CANDIDATES), reference)


def test_a_blocking_call_in_a_done_callback_is_refused_and_the_servers_keep_serving(run):
    """Done-callbacks run on the thread that reads the rank's replies: a blocking call there waited for itself
    until timeouts.request ran out, and stalled every other call to that rank meanwhile. Refused before anything is
    sent (an update refused after sending would still have stepped)."""
    reference = run.score(CONTEXTS, CANDIDATES)
    call = ("score", (CONTEXTS, CANDIDATES), {})
    with pytest.raises(RuntimeError, match="a Caller call \\('score'\\) in a future's done-callback.*Nothing was sent"):
        run.in_callback(call, call, timeout=30)
    trainable_before = run.state_dict(llm="trainable")  # refused before sending: the update changes nothing
    update = ("update", (CONTEXTS, CANDIDATES), {"llm": "trainable", "actions": [1, 0, 1, 0], "weights": [1.0] * 4})
    with pytest.raises(RuntimeError, match="a Caller call \\('update'\\) in a future's done-callback"):
        run.in_callback(call, update, timeout=30)
    after = run.state_dict(llm="trainable")
    assert all(torch.equal(trainable_before[k], after[k]) for k in after)
    assert same(run.score(CONTEXTS, CANDIDATES), reference)
    assert run.ping(1) > 0
    with pytest.raises(InvalidArgument, match="no server rank 99; the server ranks are \\[1, 2, 3, 4, 5, 6\\]"):
        run.ping(99)


def test_a_failing_head_is_named(run):
    reference = run.custom_module_fns(["value"], CONTEXTS)
    with pytest.raises(RequestError, match="head 'broken' \\(llmrl_test_plugins:BrokenHead\\) failed: "
                                           "RuntimeError: BrokenHead always fails") as err:
        run.custom_module_fns(["value", "broken"], CONTEXTS)
    assert err.value.plugin == "llmrl_test_plugins:BrokenHead"
    # a head calling sys.exit() used to end its rank (and the run): it is this request's error too
    with pytest.raises(RequestError, match="head 'exiting' \\(llmrl_test_plugins:ExitingHead\\) failed: "
                                           "SystemExit: 3"):
        run.custom_module_fns(["exiting"], CONTEXTS)
    again = run.custom_module_fns(["value"], CONTEXTS)
    assert all(torch.equal(a["value"], b["value"]) for a, b in zip(again, reference))


def test_a_failing_updater_leaves_replicas_identical(run):
    batch = {"actions": [1, 0, 1, 0] * 4, "weights": [1.0] * 16}
    contexts, candidates = CONTEXTS * 4, CANDIDATES * 4
    before = run.state_dict(llm="trainable")
    with pytest.raises(RequestError, match="after 0 optimizer step\\(s\\).*deliberate failure on replica 1"):
        run.update(contexts, candidates, llm="trainable", fail_on_replica=1, **batch)
    after = run.state_dict(llm="trainable")
    assert all(torch.equal(before[k], after[k]) for k in before), "no replica may apply a step"
    # 8 samples per replica, micro-batch 2 x accumulation 2: replica 1 fails after the first optimizer step.
    with pytest.raises(RequestError, match="after 1 optimizer step\\(s\\)") as err:
        run.update(contexts, candidates, llm="trainable", fail_on_replica=1, fail_after_steps=2, **batch)
    assert err.value.plugin == "llmrl_test_plugins:ChosenScoreUpdater"
    first, second = (run.state_dict(llm="trainable", replica=r) for r in (0, 1))
    assert all(torch.equal(first[k], second[k]) for k in first), "replicas must hold the same weights"
    assert any(not torch.equal(first[k], before[k]) for k in first), "the first step was applied by both"
    # an updater calling sys.exit() on one replica: the other is told, both serve on with the same weights
    with pytest.raises(RequestError, match="after 0 optimizer step\\(s\\).*SystemExit: deliberate exit on replica 1"):
        run.update(contexts, candidates, llm="trainable", fail_on_replica=1, fail_by_exit=True, **batch)
    first, second = (run.state_dict(llm="trainable", replica=r) for r in (0, 1))
    assert all(torch.equal(first[k], second[k]) for k in first)
    stats = run.update(contexts, candidates, llm="trainable", **batch)  # and training goes on
    assert [s["optimizer_steps"] for s in stats] == [2, 2]
    first, second = (run.state_dict(llm="trainable", replica=r) for r in (0, 1))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_slow_request_times_out_and_the_next_one_succeeds(run):
    reference = run.score(CONTEXTS, CANDIDATES)
    # The slow head takes 4 s: without the 2.5 s request timeout this call would simply succeed.
    with pytest.raises(RequestTimeoutError, match="longer than 2.5 s"):
        run.custom_module_fns(["slow"], CONTEXTS)
    assert same(run.score(CONTEXTS, CANDIDATES), reference)  # queued behind the slow one, then served


def test_idle_servers_outlive_the_collective_timeout(run, reference_models):
    from testkit import reference_scores

    time.sleep(8)  # longer than timeouts.collective: idle servers wait on their sockets, not in a collective
    model, tok = reference_models["llama"]
    for got, want in zip(run.score(CONTEXTS, CANDIDATES, llm="sharded"), reference_scores(model, tok, CONTEXTS,
                                                                                          CANDIDATES)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_rows_of_several_adapters_are_refused_under_zero3_layer_by_layer_and_the_servers_keep_serving(run):
    """ZeRO-3 over 2 replicas, weights not gathered for a call (zero3_gather_mb 0): each module call gathers its
    weights with the other replica, so both must run the same adapters. A generate naming two adapters is refused on
    each replica (each share alone names one: ["a"], ["b"]), and calls of one adapter each are served after it."""
    with pytest.raises(RequestError, match="zero3_gather_mb"):
        run.generate(["x y", "z w"], llm="sharded", peft_adapter=["a", "b"], max_new_tokens=2)
    for adapter in ("a", "b"):
        (first,), (second,) = run.generate(["x y", "z w"], llm="sharded", peft_adapter=adapter, max_new_tokens=2,
                                           do_sample=False)
        assert first["policy"] == second["policy"] == adapter



def test_a_forward_of_several_adapters_runs_under_zero3_layer_by_layer(run):
    """The same layout: a ``forward`` whose datums name adapters a and b, one datum per replica. Each replica runs
    every adapter of the call in every layer (with no token where its share has none), so their module calls gather
    together and the call ends. Adapters a and b start as the identity, so the log-probs checked against a forward of
    each adapter alone check the gathers, not the routing (test_token_adapters.py and test_run_time_adapters_live.py
    check that against adapters that differ)."""
    data = [{"model_input": [5, 9, 14, 3], "loss_fn_inputs": {"target_tokens": [9, 14, 3, 7]}},
            {"model_input": [8, 2, 11], "loss_fn_inputs": {"target_tokens": [2, 11, 6]}}]
    mixed = run.forward(data, llm="sharded", peft_adapter=["a", "b"])["loss_fn_outputs"]
    for datum, adapter, got in zip(data, ("a", "b"), mixed):
        (alone,) = run.forward([datum], llm="sharded", peft_adapter=adapter)["loss_fn_outputs"]
        torch.testing.assert_close(got["logprobs"], alone["logprobs"], atol=1e-5, rtol=0)


def _dies_cleanly(live: LiveRun, rank: int, limit: float = 60.0):
    code = live.wait(limit)  # raises (and kills the run) if it is still running after `limit` seconds
    assert code != 0
    assert f"llmrl: server rank {rank}" in live.log and "is gone" in live.log
    deadline = time.monotonic() + 10
    while live.leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live.leftover_processes() == []


@pytest.mark.parametrize("when", ["idle", "during a request"])
def test_a_killed_server_makes_the_client_raise_and_every_process_exit(tiny, when, tmp_path):
    mark = str(tmp_path / "in-flight")
    live = LiveRun({"llms": {"main": {"model": tiny["llama"], "replicas": 2, "heads": {
        "slow": {"plugin": "llmrl_test_plugins:SlowHead", "args": {"seconds": 20, "mark": mark}}}}},
                    "threads_per_rank": 1},
        launcher="deepspeed")  # the subject: DeepSpeed's launcher, our watchers and the client, when a rank dies
    try:
        victim = 2
        pid = live.servers()[victim]["pid"]
        outcome = []
        if when == "during a request":
            def call():
                try:
                    live.custom_module_fns(["slow"], CONTEXTS, timeout=120)
                except BaseException as err:  # noqa: BLE001
                    outcome.append(err)
            thread = threading.Thread(target=call)
            thread.start()
            deadline = time.monotonic() + 120
            while not list(tmp_path.glob("in-flight.*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(tmp_path.glob("in-flight.*")), "the slow request never reached a server"
        victim_process = psutil.Process(pid)
        os.kill(pid, signal.SIGKILL)
        if when == "idle":
            try:
                victim_process.wait(30)  # the server is dead before the call is made
            except psutil.TimeoutExpired:
                pass
            # ServerDiedError, or RuntimeError when the launcher ended the run before the client could answer.
            with pytest.raises((ServerDiedError, RuntimeError)) as err:
                live.score(CONTEXTS, CANDIDATES, timeout=60)
            outcome.append(err.value)
        else:
            thread.join(60)
            assert outcome, "the waiting call must raise"
        if isinstance(outcome[0], ServerDiedError):
            assert outcome[0].rank == victim and f"rank {victim}" in str(outcome[0])
        else:  # the launcher ended the client first; the run then exits non-zero (checked below)
            assert isinstance(outcome[0], RuntimeError), repr(outcome[0])
        _dies_cleanly(live, victim)
    finally:
        live.kill()


def test_an_exception_in_the_script_stops_the_servers_with_its_exit_code(tiny):
    live = LiveRun({"llms": {"main": {"model": tiny["llama"], "replicas": 2}}, "threads_per_rank": 1},
                   launcher="deepspeed")
    pids = [s["pid"] for s in live.servers().values()]
    live.raise_in_script("the RL loop crashed")
    assert live.wait(60) == 1
    assert "RuntimeError: the RL loop crashed" in live.log
    deadline = time.monotonic() + 10
    while [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert live.leftover_processes() == []


def test_a_crash_during_save_keeps_the_previous_checkpoint(tiny, tmp_path):
    from llmrl.engine.checkpoint_layout import MANIFEST, resolve_checkpoint

    path = str(tmp_path / "ckpt")
    batch = {"actions": [1, 0, 1, 0], "weights": [1.0, 1.0, 1.0, 1.0]}
    slow_config = {"llms": {"trainable": trainable(tiny, initializers=[
        {"plugin": "llmrl_test_plugins:SlowSaves", "args": {"seconds": 60, "fast_saves": 1}}])}, "threads_per_rank": 1}
    slow = LiveRun(slow_config)
    try:
        slow.update(CONTEXTS, CANDIDATES, llm="trainable", **batch)
        slow.save(path)  # the first save completes
        saved_scores = slow.score(CONTEXTS, CANDIDATES, llm="trainable")
        slow.update(CONTEXTS, CANDIDATES, llm="trainable", **batch)
        thread = threading.Thread(target=lambda: _ignore(slow.save, path), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".ckpt.staging-*/trainable/deepspeed")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob(".ckpt.staging-*")), "the second save must have started"
    finally:
        slow.kill()  # SIGKILL every process of the run in the middle of the second save
    assert resolve_checkpoint(path) == tmp_path / "ckpt" and (tmp_path / "ckpt" / MANIFEST).is_file()
    config = {"llms": {"trainable": {**trainable(tiny), "checkpoint": path}}, "threads_per_rank": 1}
    with LiveRun(config) as resumed:
        assert same(resumed.score(CONTEXTS, CANDIDATES, llm="trainable"), saved_scores)


def _ignore(fn, *args):
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - the run is killed under it
        pass
