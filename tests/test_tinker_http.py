"""The Tinker service's request plumbing, in process (no model): the HTTP server answers a request it refuses
before reading its body without reading that body as the next request; a negative Content-Length is refused; a
training client's queue refuses a ``seq_id`` that is not a non-negative integer (its ordering thread goes on); a
batch of sample requests refused for one request's input fails that request only; a missing or mistyped field is
a 400 naming it; a training client made
without a LoRA seed gets a random one, as in Tinker; an overwrite of a saved state cut between its renames loses
nothing."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading

import pytest

from llmrl.engine.tinker.batching import CallBatcher
from llmrl.engine.tinker.futures import Futures, OrderedQueue, Outcome
from llmrl.engine.tinker.http import make_server

KEY = "tml-test"


@pytest.fixture
def port():
    server = make_server(object(), "127.0.0.1", 0, KEY)  # healthz needs no service
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("refused", [("tml-wrong", "/api/v1/create_session", 401),
                                     (KEY, "/api/v1/no_such_route", 404)])
def test_a_request_refused_before_its_body_leaves_the_next_request_intact(port, refused):
    key, path, status = refused
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, body=json.dumps({"padding": "x" * 100}), headers={"X-API-Key": key})
    response = connection.getresponse()
    assert response.status == status
    response.read()
    connection.request("GET", "/api/v1/healthz", headers={"X-API-Key": KEY})  # reconnects if told to close
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})
    connection.close()


def test_a_negative_content_length_is_refused_at_once(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode()
                     + b"\r\nContent-Length: -1\r\n\r\n{}")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400") and b"Content-Length" in answer


def test_a_seq_id_that_is_not_a_non_negative_integer_is_refused_and_the_queue_goes_on():
    futures = Futures(lambda err: "user")
    queue = OrderedQueue(futures, "test", gap_wait=0.2)
    for bad in (None, "1", 1.0, -1, True):
        with pytest.raises(ValueError, match="seq_id must be a non-negative integer"):
            queue.submit(bad, lambda: Outcome("json", {}))
    first = queue.submit(1, lambda: Outcome("json", {"n": 1}))
    second = queue.submit(2, lambda: Outcome("json", {"n": 2}))
    assert futures.wait(second, 10).value == {"n": 2} and futures.wait(first, 0).value == {"n": 1}
    futures.close()


@pytest.mark.parametrize("where", ["client", "server"])
def test_a_batch_refused_for_one_requests_input_fails_that_request_only(where):
    """Refused on the client (a ValueError) or by the servers (a RequestError naming a ValueError: a prompt over
    the model's length), the batch is sent again request by request."""
    from llmrl.engine.errors import RequestError

    calls = []

    def run(keys, prompts):
        calls.append(list(prompts))
        if any(token >= 100 for prompt in prompts for token in prompt):
            if where == "server":
                raise RequestError("context 1 (600 tokens) exceeds the model's maximum length", 1, "ValueError")
            raise ValueError("a token id is outside the vocabulary")
        return [f"samples of {prompt}" for prompt in prompts]

    batcher = CallBatcher(run, window=0.05, most=3)
    good, bad, other = (batcher.submit("key", prompt) for prompt in ([1, 2], [5, 500], [3]))
    assert good.result(10) == "samples of [1, 2]" and other.result(10) == "samples of [3]"
    with pytest.raises((ValueError, RequestError), match="outside the vocabulary|exceeds the model's maximum"):
        bad.result(10)
    assert calls[0] == [[1, 2], [5, 500], [3]]  # one call for the batch, then each request alone
    assert sorted(map(tuple, map(tuple, calls[1:]))) == [([1, 2],), ([3],), ([5, 500],)]


def test_a_samplers_many_calls_do_not_hold_back_another_samplers_one():
    """Sampler a's six requests make three calls of two; sampler b's two, sent while a's first call runs, make the
    next call, before a's other two (one call at a time here). Sent as they filled, a's three calls went first."""
    started, running, release = [], threading.Event(), threading.Event()

    def run(keys, prompts):
        (key,) = set(keys)  # (no shared part: each call holds one key's batch)
        started.append((key, [prompt[0] for prompt in prompts]))
        if len(started) == 1:
            running.set()
            assert release.wait(30)
        return [f"{key}{prompt}" for prompt in prompts]

    batcher = CallBatcher(run, window=30, most=2, in_flight=1)  # batches are sent full, never by the window
    a = [batcher.submit("a", [k]) for k in range(6)]
    assert running.wait(30)
    b = [batcher.submit("b", [k]) for k in range(2)]
    release.set()
    assert [f.result(30) for f in a + b] == [f"a{[k]}" for k in range(6)] + ["b[0]", "b[1]"]
    assert started == [("a", [0, 1]), ("b", [0, 1]), ("a", [2, 3]), ("a", [4, 5])]


def test_samplers_with_the_same_parameters_share_a_call_and_take_turns_within_its_size():
    """Keys (sampler, parameters): while the first call runs, batches of a, b, c (the same parameters; c's full at
    once, a's and b's sent by the window), d (other parameters) and a seeded request wait. Then, by turns: the seeded
    request alone (never joined), c's batch (a's or b's would exceed ``most`` beside it), d's, and a's and b's in one
    call, each prompt with its own key."""

    started, running, release = [], threading.Event(), threading.Event()

    def run(keys, prompts):
        started.append([(key[0], prompt[0]) for key, prompt in zip(keys, prompts)])
        if len(started) == 1:
            running.set()
            assert release.wait(30)
        return [f"{key[0]}{prompt}" for key, prompt in zip(keys, prompts)]

    waiting = threading.Semaphore(0)

    class Observed(CallBatcher):  # (each batch that starts to wait its turn, told)
        def _enqueue(self, key, batch, alone=False):
            super()._enqueue(key, batch, alone)
            waiting.release()

    batcher = Observed(run, window=1.0, most=4, in_flight=1, shared=lambda key: key[1])
    first = [batcher.submit(("z", "p"), [k]) for k in range(4)]
    assert running.wait(30)
    a = [batcher.submit(("a", "p"), [k]) for k in range(2)]
    b = [batcher.submit(("b", "p"), [k]) for k in (10, 11)]
    seeded = batcher.submit(("s", "p"), [7], alone=True)
    c = [batcher.submit(("c", "p"), [k]) for k in range(4)]
    d = [batcher.submit(("d", "q"), [k]) for k in range(4)]
    for _ in range(6):  # z's, then s's, c's and d's at once, a's and b's once their window passed
        assert waiting.acquire(timeout=30)
    release.set()
    assert [f.result(30) for f in first + a + b + c + d] == [
        *(f"z{[k]}" for k in range(4)), "a[0]", "a[1]", "b[10]", "b[11]", *(f"c{[k]}" for k in range(4)),
        *(f"d{[k]}" for k in range(4))]
    assert seeded.result(30) == "s[7]"
    assert started[1:4] == [[("s", 7)], [("c", k) for k in range(4)], [("d", k) for k in range(4)]]
    joined = started[4]  # (a's and b's windows end on their own timers: either may wait first)
    assert sorted(joined) == [("a", 0), ("a", 1), ("b", 10), ("b", 11)] and len(started) == 5
    assert [p for p in joined if p[0] == "a"] == [("a", 0), ("a", 1)]  # each key's prompts in their order


def test_a_batch_still_in_its_window_joins_a_call_of_the_same_parameters():
    """Requests of three samplers arriving together (within the window): the first window's end sends all three in
    one call, each prompt with its own key."""
    calls = []

    def run(keys, prompts):
        calls.append([(key[0], prompt[0]) for key, prompt in zip(keys, prompts)])
        return [f"{key[0]}{prompt}" for key, prompt in zip(keys, prompts)]

    batcher = CallBatcher(run, window=3.0, most=8, shared=lambda key: key[1])  # (six submits well within it)
    futures = [batcher.submit((name, "p"), [k]) for name in "abc" for k in range(2)]
    assert [f.result(30) for f in futures] == [f"{name}{[k]}" for name in "abc" for k in range(2)]
    (call,) = calls  # (whichever window ends first sends it: the keys in any order, each key's prompts in theirs)
    assert sorted(call) == [(name, k) for name in "abc" for k in range(2)]
    assert all([p for p in call if p[0] == name] == [(name, 0), (name, 1)] for name in "abc")


def plumbing(seeds: list):
    """A TinkerService with its request plumbing only (no model behind it); ``create_adapter`` notes the seeds."""
    import itertools

    from llmrl.engine.tinker.service import TinkerService, classify

    class Caller:
        def create_adapter(self, name, *, rank, seed, targets, llm):
            seeds.append(seed)

    class Registry:
        def add_run(self, *args):
            pass

    service = TinkerService.__new__(TinkerService)
    service.caller, service.llm, service.model_name, service.registry = Caller(), "main", "tiny", Registry()
    service.model_names = ("tiny",)
    service.futures, service._lock, service.models, service._making = Futures(classify), threading.Lock(), {}, {}
    service._adapter_ids, service.poll_wait, service.optimizer_type = itertools.count(1), 0.1, "adamw"
    service.positions = 64
    return service


def test_a_request_with_a_missing_or_mistyped_field_is_a_400_naming_it():
    """They were a 404 (a missing field read as an unknown model) or a 500, which the SDK retries ten times."""
    service = plumbing([])
    server = make_server(service, "127.0.0.1", 0, KEY)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def post(route, body):
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        connection.request("POST", f"/api/v1/{route}", body=body if isinstance(body, bytes) else json.dumps(body),
                           headers={"X-API-Key": KEY})
        response = connection.getresponse()
        answer = (response.status, json.loads(response.read())["detail"])
        connection.close()
        return answer

    try:
        assert post("create_model", {"model_seq_id": 0, "lora_config": {"rank": 4}}) == \
            (400, "the request has no field 'session_id'")
        status, detail = post("create_model", {"session_id": "s", "model_seq_id": 0, "lora_config": "abc"})
        assert status == 400 and "a field of the request has the wrong type" in detail
        assert post("retrieve_future", {}) == (400, "the request has no field 'request_id'")
        assert post("retrieve_future", {"request_id": ["x"]})[0] == 400
        assert post("retrieve_future", {"request_id": "no-such-future"})[0] == 404  # unknown: still a 404
        if importlib.util.find_spec("tinker") is not None:  # the SDK's protobuf schema
            status, detail = post("forward_backward", b"\x00\x01garbage")
            assert status == 400 and "not the API's protobuf message" in detail
    finally:
        server.shutdown()
        server.server_close()
        service.futures.close()


def test_a_training_client_made_without_a_seed_gets_a_random_one_and_a_given_seed_is_kept():
    """Tinker's ``seed=None`` means a random seed: two clients made without one must not start alike."""
    seeds = []
    service = plumbing(seeds)
    for n, lora in enumerate(({"rank": 4}, {"rank": 4, "seed": None}, {"rank": 4, "seed": 7})):
        answer = service.create_model({"session_id": "s", "model_seq_id": n, "lora_config": lora})
        assert service.futures.wait(answer["request_id"], 10).kind == "json"
    service.futures.close()
    assert seeds[0] != seeds[1] and seeds[2] == 7 and all(isinstance(seed, int) for seed in seeds)


def test_a_client_naming_another_base_model_is_refused_naming_both_and_nothing_is_made():
    """A training client or sampler for a model the service does not serve would be answered by the served one:
    refused (a 400 through the HTTP layer) naming both models; the served model's own name is taken."""
    seeds = []
    service = plumbing(seeds)
    service._sampling_sessions = {}
    for make in (lambda body: service.create_model({**body, "model_seq_id": 0}),
                 lambda body: service.create_sampling_session({**body, "sampling_session_seq_id": 0})):
        with pytest.raises(ValueError, match="base_model 'meta-llama/Llama-3.2-1B' is not the model this service "
                                             "serves, 'tiny'.*base_model='tiny'"):
            make({"session_id": "s", "base_model": "meta-llama/Llama-3.2-1B"})
    assert seeds == [] and service.models == {} and service._making == {}
    answer = service.create_model({"session_id": "s", "model_seq_id": 1, "base_model": "tiny"})
    assert service.futures.wait(answer["request_id"], 10).kind == "json" and len(seeds) == 1
    service.futures.close()


def test_an_overwrite_cut_between_its_renames_keeps_the_old_state_readable_and_the_next_save_completes(tmp_path):
    """``save_state(name, overwrite=True)`` writes the new state beside the old and swaps them: cut between the two
    renames, only ``<name>%old`` is left; loading the name reads it, and the next save puts it back first."""
    import itertools
    import os

    from llmrl.engine.tinker.checkpoints import Registry
    from llmrl.engine.tinker.service import TinkerService, TrainingClient, classify

    writes = itertools.count(1)

    class Caller:
        def save_adapter(self, folder, *, peft_adapter, llm):
            os.makedirs(folder)
            with open(os.path.join(folder, "state"), "w") as f:
                f.write(str(next(writes)))

    service = TinkerService.__new__(TinkerService)
    service.caller, service.llm, service.registry = Caller(), "main", Registry(str(tmp_path))
    service.futures, service._lock, service._ids = Futures(classify), threading.Lock(), itertools.count(1)
    service.registry.add_run("s:train:0", "tiny", 4, None)
    service.models = {"s:train:0": TrainingClient("s:train:0", "tinker_1", "tiny", 4,
                                                  OrderedQueue(service.futures, "tinker_1"))}

    def save(seq_id: int, **body) -> Outcome:
        answer = service.save_weights({"model_id": "s:train:0", "path": "one", "seq_id": seq_id, **body})
        return service.futures.wait(answer["request_id"], 10)

    def held(folder: str) -> str:
        with open(os.path.join(folder, "state")) as f:
            return f.read()

    path = save(1).value["path"]
    assert "already saved a state named 'one'" in save(2).value["error"]
    folder = service.registry.folder_of(path)
    assert save(3, overwrite=True).kind == "json" and held(folder) == "2"
    os.replace(folder, folder + "%old")  # a cut between the renames: the old state aside, the new one half-written
    os.makedirs(folder + "%new")
    assert held(service.registry.folder_of(path)) == "2"
    assert save(4, overwrite=True).kind == "json" and held(folder) == "3"
    assert sorted(os.listdir(os.path.dirname(folder))) == ["one"]
    service.futures.close()


def test_a_call_of_several_samplers_refused_for_one_input_is_sent_again_sampler_by_sampler():
    """Sampler a's batch holds a prompt the servers refuse; b's joined a's call. b's requests are answered by one
    call of b's own, a's good request alone, and only a's bad request fails."""
    calls = []

    def run(keys, prompts):
        calls.append([(key[0], prompt[0]) for key, prompt in zip(keys, prompts)])
        if any(prompt[0] >= 100 for prompt in prompts):
            raise ValueError("a token id is outside the vocabulary")
        return [f"{key[0]}{prompt}" for key, prompt in zip(keys, prompts)]

    batcher = CallBatcher(run, window=1.0, most=8, shared=lambda key: key[1])
    good, bad = batcher.submit(("a", "p"), [1]), batcher.submit(("a", "p"), [500])
    others = [batcher.submit(("b", "p"), [k]) for k in (2, 3)]
    assert good.result(30) == "a[1]" and [f.result(30) for f in others] == ["b[2]", "b[3]"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bad.result(30)
    assert sorted(calls[0]) == [("a", 1), ("a", 500), ("b", 2), ("b", 3)]  # (the keys in either order)
    assert sorted(calls[1:]) == [[("a", 1)], [("a", 1), ("a", 500)], [("a", 500)], [("b", 2), ("b", 3)]]
    assert calls.index([("a", 1)]) > calls.index([("a", 1), ("a", 500)])  # a's alone, then each of its requests


class FakeTrainingCaller:
    """forward_backward as a Caller gives it: each datum's per-token log-probs and losses (here: its tokens, and
    twice them), the loss summed over every datum; a datum whose first token is 0 is refused for the whole call."""

    def __init__(self):
        self.calls = []

    def forward_backward(self, data, loss_fn, config, *, llm, peft_adapter):
        import torch

        self.calls.append([(d["model_input"][0], peft_adapter if isinstance(peft_adapter, str) else peft_adapter[k])
                           for k, d in enumerate(data)])
        if any(d["model_input"][0] == 0 for d in data):
            raise ValueError("a loss input is not finite")
        outputs = [{"logprobs": torch.tensor(d["model_input"], dtype=torch.float32),
                    "elementwise_loss": 2 * torch.tensor(d["model_input"], dtype=torch.float32)} for d in data]
        return {"loss_fn_outputs": outputs, "metrics": {"loss:sum": float(sum(o["elementwise_loss"].sum()
                                                                               for o in outputs))}}


def test_training_requests_of_several_clients_share_one_call_and_a_failed_one_is_sent_again_client_by_client():
    from concurrent.futures import ThreadPoolExecutor

    from llmrl.engine.tinker.shared_training import SharedTraining

    caller = FakeTrainingCaller()
    shared = SharedTraining(caller, "m", in_flight=2, window=2.0)  # (the three requests come well within it)
    requests = {"a": [{"model_input": [1, 2]}, {"model_input": [3]}], "b": [{"model_input": [4]}],
                "c": [{"model_input": [5, 6]}]}
    with ThreadPoolExecutor(3) as pool:
        futures = {k: pool.submit(shared.run, k, data, "cross_entropy", None, False, True)
                   for k, data in requests.items()}
        results = {k: f.result(60) for k, f in futures.items()}
    assert len(caller.calls) == 1 and sorted(caller.calls[0]) == [(1, "a"), (3, "a"), (4, "b"), (5, "c")]
    for k, data in requests.items():  # each client its own datums' outputs, and its own loss
        assert [o["logprobs"].tolist() for o in results[k]["outputs"]] == [d["model_input"] for d in data]
        assert results[k]["loss"] == 2 * sum(sum(d["model_input"]) for d in data)
    caller.calls.clear()
    requests["b"] = [{"model_input": [0]}]  # b's request fails the call it shares: a and c are answered alone
    with ThreadPoolExecutor(3) as pool:
        futures = {k: pool.submit(shared.run, k, data, "cross_entropy", None, False, True)
                   for k, data in requests.items()}
        assert futures["a"].result(60)["loss"] == 12.0 and futures["c"].result(60)["loss"] == 22.0
        with pytest.raises(ValueError, match="not finite"):
            futures["b"].result(60)
    assert len(caller.calls[0]) == 4 and sorted(caller.calls[1:]) == [[(0, "b")], [(1, "a"), (3, "a")], [(5, "c")]]
    caller.calls.clear()
    alone = shared.run("a", requests["a"], "cross_entropy", None, False, False)  # one client: no window
    assert caller.calls == [[(1, "a"), (3, "a")]] and alone["loss"] == 12.0
