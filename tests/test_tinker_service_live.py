"""The Tinker service through the public ``tinker`` SDK: a training client's ``forward_backward`` + ``optim_step``
equal the same calls made through ``Caller`` on the same config (1e-6 on every weight), ``forward`` returns the
log-probs the Caller's ``forward`` returns, sampling reads a saved sampler's snapshot and honours stops, and bad
requests reach the SDK as errors naming their cause, while the service goes on. The key is in no process's command
line, a ``tinker://`` path never leads out of ``--save-dir``, a ``create_model`` resent leaves the trained
client as it was (issue 63), and three clients training at once each end where they would alone.

The service runs as ``llmrl tinker`` in a child process (its readiness is a file it writes); the reference run is a
:class:`LiveRun` driving a Caller with the same config.
"""

from __future__ import annotations

import os

import pytest
import torch

from testkit import LiveRun
from testkit.tinker import command_lines_holding, start_tinker, stop_tinker
from testkit.tinker_sdk import datums, exported_adapter, sdk_datum, served_model

pytestmark = pytest.mark.slow
KEY = "tml-llmrl-test"
PROMPTS = [[5, 17, 33, 8], [40, 2, 91], [12, 13, 14, 15, 16]]


def config(tiny) -> dict:
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
    return {"llms": {"main": {"model": tiny["llama"], "initializers": [lora], "trainable": True,
                              "training": {"optimizer": {"type": "adamw", "lr": 1e-4}}}},
            "threads_per_rank": 1}


@pytest.fixture(scope="module")
def service(tiny, tmp_path_factory):
    running = start_tinker(config(tiny), tmp_path_factory.mktemp("tinker"), KEY)
    saved = {k: os.environ.get(k) for k in ("TINKER_BASE_URL", "TINKER_API_KEY", "TINKER_TELEMETRY")}
    os.environ.update(TINKER_BASE_URL=running["url"], TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")  # the SDK's
    yield {**running, "model": tiny["llama"]}
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    stop_tinker(running)


@pytest.fixture
def client(service):
    """An SDK client, closed after the test (its session ends: no heartbeat outlives the service)."""
    import tinker

    with tinker.ServiceClient() as sdk:
        yield sdk


@pytest.fixture(scope="module")
def reference(tiny):
    live = LiveRun(config(tiny))
    yield live
    assert live.close() == 0


def test_sdk_steps_equal_the_callers_on_the_same_config(service, client, reference, tmp_path):
    import tinker

    training = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=3).result()
    adam = tinker.AdamParams(learning_rate=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0)
    reference.create_adapter("tinker_1", rank=4, seed=3, targets=["attention", "mlp", "unembed"])
    for step in range(2):
        data = datums(step)
        sdk = training.forward_backward([sdk_datum(d) for d in data], "importance_sampling").result()
        training.optim_step(adam).result()
        want = reference.forward_backward(data, "importance_sampling", peft_adapter="tinker_1")
        reference.optim_step({"learning_rate": 2e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip_norm": 1.0,
                              "weight_decay": 0.0}, peft_adapter="tinker_1")
        for got, expected in zip(sdk.loss_fn_outputs, want["loss_fn_outputs"]):
            torch.testing.assert_close(got["logprobs"].to_torch(), expected["logprobs"], atol=1e-6, rtol=0)
        assert sdk.metrics["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], abs=1e-5)
    forward = training.forward([sdk_datum(d) for d in datums(9)], "importance_sampling").result()
    want = reference.forward(datums(9), peft_adapter="tinker_1")
    for got, expected in zip(forward.loss_fn_outputs, want["loss_fn_outputs"]):
        torch.testing.assert_close(got["logprobs"].to_torch(), expected["logprobs"], atol=1e-6, rtol=0)
    path = training.save_state("after").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/after")
    reference.save(str(tmp_path / "reference"))
    got = exported_adapter(service["folder"] / "saved", "after/peft/adapter_model.safetensors")  # save_adapter's
    expected = exported_adapter(tmp_path, "adapters/tinker_1/adapter_model.safetensors")  # Caller.save's export
    assert got.keys() == expected.keys() and len(got) > 10
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=0)


def test_sampling_reads_a_saved_samplers_weights_and_honours_stops(service, client):
    import tinker

    training = client.create_lora_training_client(base_model=served_model(client), rank=4).result()
    first = training.save_weights_for_sampler("first-a").result().path
    sampler = client.create_sampling_client(model_path=first).result()
    prompt = tinker.ModelInput.from_ints([5, 17, 33, 8])
    greedy = tinker.SamplingParams(max_tokens=8, temperature=0.0)
    free = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert len(free.tokens) == 8 and free.stop_reason == "length" and len(free.logprobs) == 8
    stop = free.tokens[3]
    stopped = sampler.sample(prompt, num_samples=1, sampling_params=tinker.SamplingParams(
        max_tokens=8, temperature=0.0, stop=[stop])).result().sequences[0]
    assert stopped.tokens == free.tokens[:free.tokens.index(stop) + 1] and stopped.stop_reason == "stop"
    absent = next(t for t in range(10, 1000) if t not in free.tokens)  # Tinker: a list of ids stops at any of them
    either = sampler.sample(prompt, num_samples=1, sampling_params=tinker.SamplingParams(
        max_tokens=8, temperature=0.0, stop=[absent, stop])).result().sequences[0]
    assert either.tokens == stopped.tokens and either.stop_reason == "stop"
    with pytest.raises(Exception, match="topk_prompt_logprobs"):  # not computed: refused, not answered without it
        sampler.sample(prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    sampled = sampler.sample(prompt, num_samples=3, sampling_params=tinker.SamplingParams(
        max_tokens=5, temperature=1.0, seed=1)).result()
    assert len(sampled.sequences) == 3 and all(len(s.tokens) == len(s.logprobs) for s in sampled.sequences)
    # a step later, a sampler made from the saved path still reads the saved weights, whatever was saved since
    data = [sdk_datum(d) for d in datums(4)]
    training.forward_backward(data, "importance_sampling").result()
    training.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("first_a").result().path  # a name that folds like "first-a"
    assert path.endswith("/sampler_weights/first_a")
    again = client.create_sampling_client(model_path=first).result()
    assert again.sample(prompt, 1, greedy).result().sequences[0].tokens == free.tokens
    # greedy decoding with several samples: one decoding, copied (Hugging Face refused several greedy sequences)
    copies = sampler.sample(prompt, num_samples=3, sampling_params=greedy).result().sequences
    assert [c.tokens for c in copies] == [free.tokens] * 3
    # max_tokens unset: to EOS or the model's maximum length (it was cut at 64 tokens)
    unset = sampler.sample(prompt, 1, tinker.SamplingParams(temperature=0.0, stop=[])).result().sequences[0]
    assert unset.tokens[:8] == free.tokens and len(unset.tokens) > 64 and unset.stop_reason == "length"


def test_a_datums_own_clip_thresholds_are_read_per_token(service, client):
    """The SDK's Datum lists clip_low_threshold / clip_high_threshold among a datum's inputs: they bound each token's
    ratio in place of loss_fn_config's (they were dropped without a word)."""

    training = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=3).result()
    data = datums(50)
    outputs = training.forward([sdk_datum({"model_input": d["model_input"], "loss_fn_inputs": {
        "target_tokens": d["loss_fn_inputs"]["target_tokens"], "weights": [1.0] * len(d["model_input"])}})
        for d in data], "cross_entropy").result().loss_fn_outputs
    logp = [o["logprobs"].to_torch() for o in outputs]
    for datum, lp in zip(data, logp):
        n = len(lp)
        datum["loss_fn_inputs"]["logprobs"] = (lp + 0.05 * torch.randn(n)).tolist()  # ratios near 1
        datum["loss_fn_inputs"]["clip_low_threshold"] = [0.99] * n
        datum["loss_fn_inputs"]["clip_high_threshold"] = [1.01] * n
    got = training.forward([sdk_datum(d) for d in data], "ppo").result().loss_fn_outputs
    for out, datum, lp in zip(got, data, logp):
        inputs = {k: torch.tensor(v) for k, v in datum["loss_fn_inputs"].items()}
        ratio = torch.exp(lp - inputs["logprobs"])
        clipped = ratio.clamp(inputs["clip_low_threshold"], inputs["clip_high_threshold"])
        want = -torch.minimum(ratio * inputs["advantages"], clipped * inputs["advantages"])
        torch.testing.assert_close(out["elementwise_loss"].to_torch(), want, atol=1e-5, rtol=0)
    datum = data[0]
    datum["loss_fn_inputs"]["clip_high_threshold"] = [0.2] * len(datum["model_input"])  # an epsilon: refused
    with pytest.raises(Exception, match=r"clip_high_threshold'\]\[0\] is 0.2\d*: a clip threshold is a bound on the"):
        training.forward([sdk_datum(datum)], "ppo").result()


def test_bad_requests_reach_the_sdk_naming_their_cause_and_the_service_goes_on(service, client):
    import tinker

    training = client.create_lora_training_client(base_model=served_model(client), rank=4).result()
    data = [sdk_datum(d) for d in datums(5)]
    with pytest.raises(Exception, match="stable_reinforce' is not supported"):
        training.forward_backward(data, "stable_reinforce").result()
    short = sdk_datum(datums(6)[0])
    short.loss_fn_inputs["advantages"] = tinker.TensorData.from_torch(torch.ones(2))
    with pytest.raises(Exception, match=r"'advantages'\] has 2 values"):
        training.forward_backward([short], "importance_sampling").result()
    out = training.forward_backward(data, "importance_sampling").result()  # the service goes on
    assert len(out.loss_fn_outputs) == 3
    training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()


def test_a_request_whose_cost_passes_the_models_bounds_is_refused_before_it_is_paid(service, client):
    """A 100-byte body announcing a sparse tensor of 8M values (rank 0 densified it: 400 MB) and a body nested
    200k deep (a 500, retried by the SDK) are 400s naming their cause; the service goes on."""
    import http.client
    import json
    import urllib.parse

    from tinker.proto import tinker_public_pb2 as pb

    training = client.create_lora_training_client(base_model=served_model(client), rank=4).result()
    weights = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[8_000_000], sparse_csr=pb.SparseCsr())
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=bytes(12)))],
                     loss_fn_inputs={"weights": weights})
    url = urllib.parse.urlsplit(service["url"])
    for route, body, cause in (
            ("forward_backward", pb.ForwardBackwardRequest(model_id=training.model_id, loss_fn="cross_entropy",
                                                           data=[datum]).SerializeToString(),
             "data[0].loss_fn_inputs['weights'] holds 8000000 values"),
            ("create_session", b"[" * 200_000 + b"]" * 200_000, "nests")):
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        connection.request("POST", f"/api/v1/{route}", body=body, headers={"X-API-Key": KEY})
        response = connection.getresponse()
        status, detail = response.status, json.loads(response.read())["detail"]
        connection.close()
        assert status == 400 and cause in detail, detail
    out = training.forward_backward([sdk_datum(d) for d in datums(5)], "cross_entropy").result()  # it goes on
    assert len(out.loss_fn_outputs) == 3


def test_a_saved_state_makes_new_training_clients_with_or_without_its_optimizer_state(service, client):
    import tinker

    adam = tinker.AdamParams(learning_rate=3e-3)

    def step(training, seed: int) -> None:
        training.forward_backward([sdk_datum(d) for d in datums(seed)], "importance_sampling").result()
        training.optim_step(adam).result()

    def logprobs(training) -> list[torch.Tensor]:
        out = training.forward([sdk_datum(d) for d in datums(30)], "importance_sampling").result()
        return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]

    first = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=5).result()
    step(first, 10)
    path = first.save_state("one").result().path
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    fresh = client.create_training_client_from_state(path).result()
    assert resumed.get_info().model_data.tokenizer_id == first.get_info().model_data.tokenizer_id
    for training in (first, resumed, fresh):
        step(training, 11)
    want = logprobs(first)
    for got, expected in zip(logprobs(resumed), want):  # the Adam moments came along: the same step
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert max(float((g - w).abs().max()) for g, w in zip(logprobs(fresh), want)) > 1e-4  # fresh moments differ
    with pytest.raises(Exception, match="already saved a state named 'one'"):
        first.save_state("one").result()  # nothing is replaced unless asked
    assert first.save_state("one", overwrite=True).result().path == path
    for got, expected in zip(logprobs(client.create_training_client_from_state(path).result()), want):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)  # the state after the second step
    rest = client.create_rest_client()
    run = rest.get_training_run(first.model_id).result()
    assert run.last_checkpoint.tinker_path == path and run.lora_rank == 4
    assert [c.tinker_path for c in rest.list_checkpoints(first.model_id).result().checkpoints] == [path]
    assert first.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(first.model_id).result().checkpoints == []
    with pytest.raises(Exception, match="no saved state at"):
        client.create_training_client_from_state(path).result()


def test_three_clients_training_at_once_each_end_where_it_would_alone(service, client, reference):
    """Three training clients (three adapters: three tenants), each in a thread, send their ``forward_backward``
    before any steps: the three adapters' gradients are pending together, and each ``optim_step`` steps its own.
    Their requests arrive together and may share one call, each datum on its own client's adapter. Each then scores
    as the same calls made alone, one adapter after the other, leave it (a Caller), to 1e-5 (a shared call sums in
    another order: measured 2.4e-6 on log-probs of order 7); and
    their samplers, sampling at once (greedy: the service may run the three adapters' prompts in one batched pass),
    each give the tokens and log-probs (1e-5) of a ``generate`` of its adapter alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import tinker

    seeds = (21, 22, 23)
    greedy = tinker.SamplingParams(max_tokens=6, temperature=0.0)
    adam = tinker.AdamParams(learning_rate=3e-3)
    settings = {"learning_rate": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                "grad_clip_norm": 0.0}  # the SDK's defaults, which it sends
    clients = [client.create_lora_training_client(base_model=served_model(client), rank=4, seed=s).result()
               for s in seeds]
    together = threading.Barrier(len(clients))

    def train(k: int) -> list[torch.Tensor]:
        training = clients[k]
        for step in range(2):
            training.forward_backward([sdk_datum(d) for d in datums(40 + 10 * k + step)],
                                      "importance_sampling").result()
            together.wait(timeout=300)  # every client's gradients are pending before any steps
            training.optim_step(adam).result()
            together.wait(timeout=300)
        out = training.forward([sdk_datum(d) for d in datums(30)], "importance_sampling").result()
        sampler = training.save_weights_and_get_sampling_client(f"tenant-{k}")
        together.wait(timeout=300)
        pending = [sampler.sample(tinker.ModelInput.from_ints(p), 1, greedy) for p in PROMPTS]
        return [o["logprobs"].to_torch() for o in out.loss_fn_outputs], [p.result().sequences[0] for p in pending]

    with ThreadPoolExecutor(len(clients)) as pool:
        got = list(pool.map(train, range(len(clients))))
    for k, seed in enumerate(seeds):
        name = f"alone_{seed}"
        reference.create_adapter(name, rank=4, seed=seed, targets=["attention", "mlp", "unembed"])
        for step in range(2):
            reference.forward_backward(datums(40 + 10 * k + step), "importance_sampling", peft_adapter=name)
            reference.optim_step(settings, peft_adapter=name)
        want = reference.forward(datums(30), peft_adapter=name)["loss_fn_outputs"]
        for g, w in zip(got[k][0], want):
            torch.testing.assert_close(g, w["logprobs"], atol=1e-5, rtol=0)
        alone = reference.generate(PROMPTS, peft_adapter=name, max_new_tokens=6, do_sample=False)
        for sampled, (sample,) in zip(got[k][1], alone):
            assert sampled.tokens == sample["tokens"].tolist()
            torch.testing.assert_close(torch.tensor(sampled.logprobs), sample["logprobs"], atol=1e-5, rtol=0)
    assert max(float((a - b).abs().max()) for a, b in zip(got[0][0], got[1][0])) > 1e-4  # three adapters, not one


def test_gspo_through_the_sdk_equals_the_callers(service, client, reference):
    import tinker

    training = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=8).result()
    reference.create_adapter("gspo_ref", rank=4, seed=8, targets=["attention", "mlp", "unembed"])
    data = datums(40)
    for datum in data:
        n = len(datum["model_input"])
        datum["loss_fn_inputs"]["sequence_ratio_mask"] = [0.0] * (n // 2) + [1.0] * (n - n // 2)
    sdk = training.forward_backward([sdk_datum(d) for d in data], "gspo").result()
    want = reference.forward_backward(data, "gspo", peft_adapter="gspo_ref")
    for got, expected in zip(sdk.loss_fn_outputs, want["loss_fn_outputs"]):
        torch.testing.assert_close(got["elementwise_loss"].to_torch(), expected["elementwise_loss"], atol=1e-6,
                                   rtol=0)
    training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
    reference.optim_step({"learning_rate": 1e-3}, peft_adapter="gspo_ref")


def test_the_key_shows_in_no_command_line_of_the_services_processes(service):
    """Given by ``--api-key-file``, the key is in no ``/proc/<pid>/cmdline`` of the command, the launcher or the
    ranks (``--api-key`` showed it in five)."""
    assert len(command_lines_holding(service, "llmrl")) >= 3  # the command, the launcher, the ranks: all were read
    assert command_lines_holding(service, KEY) == {}


def test_a_state_outside_the_save_dir_loads_into_no_client_and_errors_name_no_host_folder(service, client):
    import shutil

    training = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=6).result()
    path = training.save_state("escape").result().path
    saved = next((service["folder"] / "saved").rglob("escape"))
    shutil.copytree(saved, service["folder"] / "weights" / "x")  # <save-dir>/../weights/x: a state, outside
    for load in (lambda: client.create_training_client_from_state("tinker://../weights/x").result(),
                 lambda: training.load_state("tinker://../weights/x").result()):
        with pytest.raises(Exception, match=r"'tinker://\.\./weights/x' is not a checkpoint path") as refused:
            load()
        assert str(service["folder"]) not in str(refused.value)
    with pytest.raises(Exception, match="no saved state at 'tinker://") as missing:
        client.create_training_client_from_state(path.replace("/escape", "/absent")).result()
    assert str(service["folder"]) not in str(missing.value)
    training.forward([sdk_datum(d) for d in datums(60)], "cross_entropy").result()  # the client goes on


def post(service, route: str, body: dict) -> dict:
    """A raw JSON request to the service, as the SDK sends it again after a failed connection."""
    import http.client
    import json
    import urllib.parse

    url = urllib.parse.urlsplit(service["url"])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request("POST", f"/api/v1/{route}", body=json.dumps(body),
                           headers={"X-API-Key": KEY, "Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        return answer
    finally:
        connection.close()


def test_create_model_resent_leaves_the_trained_client_as_it_was(service, client):
    """The resend registered a fresh, untrained adapter under the same model id: the trained one was lost, and
    the client's next request waited 10 s for a seq_id its new queue expected."""
    import tinker

    training = client.create_lora_training_client(base_model=served_model(client), rank=4, seed=9).result()
    data = [sdk_datum(d) for d in datums(70)]
    training.forward_backward(data, "importance_sampling").result()
    training.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    trained = [o["logprobs"].to_torch() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]
    session, seq = training.model_id.rsplit(":train:", 1)
    answer = post(service, "create_model", {"session_id": session, "model_seq_id": int(seq),
                                             "base_model": service["model"], "lora_config": {"rank": 4, "seed": 9},
                                             "type": "create_model"})
    assert answer["model_id"] == training.model_id
    while True:  # its future: the first request's answer
        done = post(service, "retrieve_future", {"request_id": answer["request_id"]})
        if done.get("type") != "try_again":
            break
    assert done == {"type": "create_model", "model_id": training.model_id}
    after = [o["logprobs"].to_torch() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]
    for got, want in zip(after, trained):  # still the trained adapter
        torch.testing.assert_close(got, want, atol=0, rtol=0)
