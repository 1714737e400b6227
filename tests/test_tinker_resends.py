"""Every Tinker request that makes or changes state is idempotent by its ids (issue 63, point 3): the SDK resends a
request whose connection failed, and the resent one must get the first one's future (or answer) back, never be
made or applied twice. Each kind is sent twice on a stand-in Caller (no model) that notes every call:
``create_model`` and ``load_weights`` into a new client (``session_id`` + ``model_seq_id``), a training client's
``forward_backward``, ``forward``, ``optim_step``, ``save_weights``, ``save_weights_for_sampler`` and
``load_weights`` (``seq_id``), ``create_sampling_session`` (``session_id`` + ``sampling_session_seq_id``) and a
checkpoint's delete."""

from __future__ import annotations

import time

import numpy as np
import pytest

from testkit.tinker_caller import fake_service


@pytest.fixture
def served(tmp_path):
    """A service on the stand-in Caller, its save folder ``tmp_path``, and that Caller; its futures closed after."""
    service, caller = fake_service(str(tmp_path))
    yield service, caller
    service.futures.close()


def wait(service, answer: dict):
    outcome = service.futures.wait(answer["request_id"], 10)
    assert outcome is not None and outcome.kind != "error", outcome
    return outcome


def test_create_model_resent_gets_the_first_clients_future_and_its_trained_adapter_stays(served):
    """It registered a fresh, untrained adapter under the same id (the trained one leaked), and the new client's
    queue then waited 10 s for a seq_id it expected."""
    service, caller = served
    body = {"session_id": "s", "model_seq_id": 0, "lora_config": {"rank": 4, "seed": 1}}
    first = service.create_model(body)
    wait(service, first)
    client = service.models["s:train:0"]
    stepped = service.optim_step({"model_id": "s:train:0", "seq_id": 1, "adam_params": {"learning_rate": 0.1}})
    wait(service, stepped)
    again = service.create_model(dict(body))  # the same request, resent
    assert again == first and wait(service, again).value == {"type": "create_model", "model_id": "s:train:0"}
    assert service.models["s:train:0"] is client and caller.count("create_adapter") == 1
    start = time.monotonic()  # the client's next request runs at once: its queue is the first one
    wait(service, service.optim_step({"model_id": "s:train:0", "seq_id": 2, "adam_params": {}}))
    assert time.monotonic() - start < 5
    assert caller.calls.count(("optim_step", client.adapter)) == 2
    other = service.create_model({**body, "model_seq_id": 1})  # a new model_seq_id: a new client
    assert other["request_id"] != first["request_id"]
    wait(service, other)
    assert caller.count("create_adapter") == 2 and service.models["s:train:1"].adapter != client.adapter


def test_load_weights_into_a_new_client_resent_makes_it_once(served):
    service, caller = served
    wait(service, service.create_model({"session_id": "s", "model_seq_id": 0}))
    path = wait(service, service.save_weights({"model_id": "s:train:0", "path": "one", "seq_id": 1})
                ).value["path"]
    body = {"session_id": "s", "model_seq_id": 1, "path": path, "optimizer": True}
    answers = [service.load_weights(dict(body)) for _ in range(3)]  # resent before the first is done, and after
    wait(service, answers[0])
    answers.append(service.load_weights(dict(body)))
    assert all(answer == answers[0] for answer in answers)
    assert caller.count("load_adapter") == 1 and caller.count("create_adapter") == 1
    # a create_model resent with the ids of a client made from a state gets that client, not a fresh adapter
    assert service.create_model({"session_id": "s", "model_seq_id": 1}) == answers[0]
    assert caller.count("create_adapter") == 1


def forward_backward_body(model_id: str, seq_id: int, forward_only: bool) -> bytes:
    pytest.importorskip("tinker")  # the SDK's protobuf schema
    from llmrl.engine.tinker.wire import pb

    request = pb().ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy",
                                          forward_only=forward_only)
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6, 7], dtype=np.int32).tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = 2, np.array([6, 7, 8], dtype=np.int64).tobytes()
    target.shape.append(3)
    return request.SerializeToString()


@pytest.mark.parametrize("kind", ["forward_backward", "forward", "optim_step", "save_weights",
                                  "save_weights_for_sampler", "unnamed_sampler", "load_weights"])
def test_a_training_clients_request_resent_with_its_seq_id_runs_once(served, kind):
    service, caller = served
    wait(service, service.create_model({"session_id": "s", "model_seq_id": 0}))
    saved = wait(service, service.save_weights({"model_id": "s:train:0", "path": "base", "seq_id": 1}))
    before = list(caller.calls)
    send = {
        "forward_backward": lambda: service.forward_backward(forward_backward_body("s:train:0", 2, False)),
        "forward": lambda: service.forward_backward(forward_backward_body("s:train:0", 2, True)),
        "optim_step": lambda: service.optim_step({"model_id": "s:train:0", "seq_id": 2, "adam_params": {}}),
        "save_weights": lambda: service.save_weights({"model_id": "s:train:0", "seq_id": 2, "path": "two"}),
        "save_weights_for_sampler": lambda: service.save_weights_for_sampler(
            {"model_id": "s:train:0", "seq_id": 2, "path": "sampled"}),
        "unnamed_sampler": lambda: service.save_weights_for_sampler({"model_id": "s:train:0", "seq_id": 2}),
        "load_weights": lambda: service.load_weights({"model_id": "s:train:0", "seq_id": 2,
                                                      "path": saved.value["path"]}),
    }[kind]
    first = send()
    result = wait(service, first)
    samplers = dict(service.samplers)
    again = send()
    assert again == first and wait(service, again).value == result.value
    new_calls = caller.calls[len(before):]
    assert len(new_calls) == 1, new_calls  # applied once
    assert service.samplers == samplers
    if kind == "save_weights":  # a name drawn for the resend would have been saved twice
        assert [c.name for c in service.registry.runs["s:train:0"].checkpoints] == ["base", "two"]


def test_create_sampling_session_resent_gets_the_same_sampler(served):
    service, _ = served
    body = {"session_id": "s", "sampling_session_seq_id": 0, "base_model": "tiny"}
    first = service.create_sampling_session(body)
    assert service.create_sampling_session(dict(body)) == first and len(service.samplers) == 1
    other = service.create_sampling_session({**body, "sampling_session_seq_id": 1})
    assert other["sampling_session_id"] != first["sampling_session_id"] and len(service.samplers) == 2


def test_a_delete_resent_after_it_was_done_answers_the_same(served, tmp_path):
    """The first delete removed the checkpoint; the resent one answered 404, an error for a request that worked."""
    service, _ = served
    wait(service, service.create_model({"session_id": "s", "model_seq_id": 0}))
    wait(service, service.save_weights({"model_id": "s:train:0", "path": "one", "seq_id": 1}))
    assert service.delete_checkpoint("s:train:0", "weights/one") == {}
    assert service.delete_checkpoint("s:train:0", "weights/one") == {}
    with pytest.raises(LookupError, match="has no checkpoint 'weights/two'"):  # never there: still refused
        service.delete_checkpoint("s:train:0", "weights/two")
    assert not (tmp_path / "s%3Atrain%3A0" / "weights" / "one").exists()
