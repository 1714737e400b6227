"""Weights written between two decode batches of one ``generate`` call (``sync_weights(in_flight=True)``): the
batches before the write decode from the old weights and the batches after it from the new, on Hugging Face's
``generate`` and on llmrl's loop (the adapter merged or not), each compared with a whole call on those weights; the
samples drawn before the write are stamped with the old version; the server serves a write in flight only when it
is the next request queued; and the hook is refused where the call cannot take it."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.model.weight_sync import writes_between_batches
from llmrl.engine.requests.write_weights import WriteWeightsRequest
from llmrl.engine.server.serve import Server
from llmrl.engine.transport import messages
from testkit.decoding import same_samples

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]
GREEDY = {"max_new_tokens": 6, "do_sample": False}


@pytest.fixture
def adapted(reference_models):
    """A fresh copy of the tiny Llama with a LoRA adapter whose B is not zero (the test writes into it)."""
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model), tok


def _lora_bs(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "lora_B" in n]


def _call(model, tok, settings, prompts=PROMPTS, between=None):
    """One ``generate`` call, one prompt per batch (rows capped at 1)."""
    decoder = Decoder(GenerationSettings(**settings), "cpu") if settings is not None else None
    plan = plan_generate(model, tok, "causal", prompts, GREEDY, 8192, 1, 512)
    return generate(model, tok, "causal", plan, "cpu", decoder=decoder, between_batches=between)


@pytest.mark.parametrize("settings", [None, {}, {"merge_adapter": True}], ids=["hf", "llmrl", "llmrl-merged"])
def test_batches_after_a_write_decode_from_the_new_weights_and_those_before_from_the_old(adapted, settings):
    model, tok = adapted
    old = _call(model, tok, settings)
    with torch.no_grad():  # what a sync writes (an optimizer step's worth of change), then taken back
        for b in _lora_bs(model):
            b.mul_(4.0)
    new = _call(model, tok, settings)
    with torch.no_grad():
        for b in _lora_bs(model):
            b.div_(4.0)
    assert not same_samples(old[2:], new[2:]), "the write must change these prompts' tokens for the test to see it"
    drawn = []

    def write_before_the_third_batch(results):
        drawn.append(sum(len(r) for r in results))
        if len(drawn) == 2:
            with torch.no_grad():
                for b in _lora_bs(model):
                    b.mul_(4.0)

    mixed = _call(model, tok, settings, between=write_before_the_third_batch)
    assert drawn == [1, 2, 3]  # called before each batch but the first, with the samples drawn so far
    assert same_samples(mixed[:2], old[:2]) and same_samples(mixed[2:], new[2:])


def test_the_hook_is_refused_with_prompt_logprobs_and_under_lockstep(adapted):
    model, tok = adapted
    plan = plan_generate(model, tok, "causal", PROMPTS[:2], {**GREEDY, "prompt_logprobs": True}, 8192, 1, 512)
    with pytest.raises(ValueError, match="prompt log-probs"):
        generate(model, tok, "causal", plan, "cpu", between_batches=lambda results: None)
    plan = plan_generate(model, tok, "causal", PROMPTS[:2], GREEDY, 8192, 1, 512)
    with pytest.raises(ValueError, match="lockstep"):
        generate(model, tok, "causal", plan, "cpu", lockstep=0, between_batches=lambda results: None)


def _served(versions: dict, swapped_in=None):
    return SimpleNamespace(run_time=SimpleNamespace(versions=versions, swapped_in=swapped_in))


def test_samples_drawn_before_a_write_keep_the_version_they_came_from():
    versions = {"default": 3}
    served = _served(versions)
    taken = []

    def take(before):  # a write is next: stamp what was drawn, then the write gives the adapter version 4
        before()
        versions["default"] = 4
        taken.append(True)
        return True

    between = writes_between_batches(served, "default", take)
    results = [[{"tokens": 1}], [], []]
    between(results)
    results[1].append({"tokens": 2})
    from llmrl.engine.model.version_counts import stamped

    stamped(results, served, "default")
    assert taken == [True]
    assert (results[0][0]["policy_version"], results[1][0]["policy_version"]) == (3, 4)
    assert results[0][0]["policy"] == results[1][0]["policy"] == "default"
    assert writes_between_batches(served, "default", None) is None  # no server behind the backend: no hook


def test_no_write_is_taken_while_a_weight_snapshots_tensors_are_swapped_in():
    served = _served({None: 0}, swapped_in="frozen")
    calls = []
    writes_between_batches(served, "frozen", lambda before: calls.append(before) or True)([[{}]])
    assert calls == []


def _server(*queued) -> tuple[Server, list]:
    server = Server.__new__(Server)
    server.inbox, server.busy_with = queue.Queue(), 7
    for message in queued:
        server.inbox.put(message)
    events: list = []
    server._handle = lambda request: events.append(("handled", request.id)) or messages.Reply(request.id, 1, value={})
    server._reply = lambda reply: events.append(("replied", reply.id))
    return server, events


def _write(in_flight: bool) -> WriteWeightsRequest:
    return WriteWeightsRequest({}, "default", 1, "learner", None, in_flight)


def test_the_server_serves_a_write_in_flight_only_when_it_is_the_next_request_queued():
    generate_next = messages.Request(8, "generate", None)
    server, events = _server(generate_next, messages.Request(9, "write_weights", _write(True)))
    assert server._take_queued_write(lambda: events.append("before")) is False  # a request sent before it waits
    assert events == [] and server.inbox.qsize() == 2

    server, events = _server(messages.Request(9, "write_weights", _write(False)))
    assert server._take_queued_write(lambda: events.append("before")) is False  # not sent in flight: its turn
    assert events == [] and server.inbox.qsize() == 1

    server, events = _server(messages.Request(9, "write_weights", _write(True)), generate_next)
    assert server._take_queued_write(lambda: events.append("before")) is True
    assert events == ["before", ("handled", 9), ("replied", 9)]
    assert server.inbox.get_nowait() is generate_next and server.inbox.empty()

    def failing_stamp():
        raise RuntimeError("stamping failed")

    write = messages.Request(9, "write_weights", _write(True))
    server, events = _server(write)
    with pytest.raises(RuntimeError, match="stamping failed"):  # the generate fails, and says why
        server._take_queued_write(failing_stamp)
    assert events == [] and server.inbox.get_nowait() is write  # the write is still queued: served in its turn


def test_the_gate_head_holds_its_rank_while_the_file_is_locked_and_lets_go_with_the_lock(tmp_path):
    """The live in-flight test's GateHead (llmrl_test_plugins): its forward waits while the file is locked, gives up
    after its timeout, and returns once the lock is let go."""
    import fcntl

    from llmrl_test_plugins import GateHead

    gate = tmp_path / "gate"
    gate.touch()
    outputs = SimpleNamespace(num_contexts=2)
    with open(gate, "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="stayed locked for 0.2 s"):
            GateHead(None, str(gate), timeout=0.2).forward(outputs)
    assert torch.equal(GateHead(None, str(gate), timeout=30).forward(outputs), torch.zeros(2))
