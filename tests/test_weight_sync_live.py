"""``Caller.sync_weights``: a learner's weights copied into a sampler LLM that serves the same model on other ranks,
over a group of the two LLMs' ranks (``via="group"``) and through the client (``via="client"``).

After every optimizer step of the learner and a sync, the sampler's weights equal the learner's bit for bit (float32):
one LoRA adapter's (a learner of 2 replicas under ZeRO-2, one of 1, and one of 2 tensor-parallel ranks), or the whole
model's (no LoRA: 2 replicas under ZeRO-1, and 1; into a sampler of 2 replicas). The sampler's samples then carry the
learner's policy version, and its log-probs equal the learner's. A sync sent while the sampler has a ``generate`` in
flight leaves that call on the old weights; one sent ``in_flight`` reaches the call's batches after it, and each sample
says which version it came from. A sync the sampler cannot take (it trains, its adapter has other tensors or another
LoRA scaling) is refused naming why, and the sampler keeps its weights."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.snapshots import without_adapter
from testkit import LiveRun

pytestmark = pytest.mark.slow
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
LORA_ALPHA_64 = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4, "alpha": 64}}}}
PROMPT = [1, 45, 96, 173]


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> str:
    """The file that the sampler's ``gate`` head waits on while the test holds it locked."""
    path = tmp_path_factory.mktemp("gate") / "gate"
    path.touch()
    return str(path)


@pytest.fixture(scope="module")
def run(tiny, gate):
    adam = {"optimizer": {"type": "adam", "lr": 0.01}}
    llms = {
        "learner": {"model": tiny["llama"], "replicas": 2, "initializers": [LORA], "trainable": True,
                    "training": {**adam, "zero_stage": 2}},
        "learner_one": {"model": tiny["llama"], "initializers": [LORA], "trainable": True, "training": adam},
        "learner_tp": {"model": tiny["llama"], "tensor_parallel": 2, "initializers": [LORA], "trainable": True,
                       "training": adam},  # the adapter whole on each rank, applied in parts (tp_lora)
        "full": {"model": tiny["llama"], "replicas": 2, "trainable": True, "training": {**adam, "zero_stage": 1}},
        "full_one": {"model": tiny["llama"], "trainable": True, "training": adam},
        "sampler": {"model": tiny["llama"], "initializers": [LORA],
                    "heads": {"gate": {"plugin": "llmrl_test_plugins:GateHead", "args": {"path": gate}}}},
        "sampler_full": {"model": tiny["llama"], "replicas": 2},
        "sampler_alpha": {"model": tiny["llama"], "initializers": [LORA_ALPHA_64]},  # same shapes, another scaling
    }
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def step(run, llm: str, k: int) -> int:
    """One optimizer step of ``llm`` on a cross-entropy datum (different each ``k``); the new policy version."""
    tokens = PROMPT + [(37 * k + 11) % 250 + 3, (53 * k + 7) % 250 + 3]
    datum = {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:],
                                                            "weights": [1.0] * (len(tokens) - 1)}}
    run.forward_backward([datum], "cross_entropy", llm=llm)
    return run.optim_step({"learning_rate": 0.05}, llm=llm)["policy_version"]


def lora_weights(state: dict) -> dict:
    return {k: v for k, v in state.items() if without_adapter(k, "default") is not None}


def assert_equal_states(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs by {float((got[key] - value).abs().max())}"


@pytest.mark.parametrize("learner", ["learner", "learner_one", "learner_tp"])
@pytest.mark.parametrize("via", ["group", "client"])
def test_a_lora_learners_adapter_reaches_the_sampler_bit_for_bit_after_every_step(run, via, learner):
    base = {k: v for k, v in run.state_dict(llm="sampler").items() if without_adapter(k, "default") is None}
    for k in range(3):
        version = step(run, learner, k + (10 if via == "client" else 0))
        synced = run.sync_weights(learner, "sampler", via=via)
        assert (synced["adapter"], synced["policy_version"]) == ("default", version)
        learner_weights = lora_weights(run.state_dict(llm=learner))
        assert synced["tensors"] == len(learner_weights)
        assert synced["bytes"] == sum(v.numel() * 4 for v in learner_weights.values())
        sampler = run.state_dict(llm="sampler")
        assert_equal_states(lora_weights(sampler), learner_weights)
        assert_equal_states({k: v for k, v in sampler.items() if k in base}, base)  # the base is untouched
        assert run.generate([PROMPT], llm="sampler", max_new_tokens=1)[0][0]["policy_version"] == version
    assert any(float(v.abs().max()) > 0 for k, v in learner_weights.items() if "lora_B" in k)  # B moved off 0
    datum = {"model_input": PROMPT + [29], "loss_fn_inputs": {"target_tokens": PROMPT[1:] + [29, 31]}}
    sampler_lp, learner_lp = (run.forward([datum], llm=llm)["loss_fn_outputs"][0]["logprobs"]
                              for llm in ("sampler", learner))
    assert torch.allclose(torch.as_tensor(sampler_lp), torch.as_tensor(learner_lp), rtol=0, atol=1e-6)


@pytest.mark.parametrize("learner", ["full", "full_one"])
@pytest.mark.parametrize("via", ["group", "client"])
def test_a_learner_without_lora_reaches_the_sampler_whole_bit_for_bit_after_every_step(run, via, learner):
    for k in range(2):
        version = step(run, learner, k + (10 if via == "client" else 0))
        synced = run.sync_weights(learner, "sampler_full", via=via)
        assert (synced["adapter"], synced["policy_version"]) == (None, version)
        assert_equal_states(run.state_dict(llm="sampler_full"), run.state_dict(llm=learner))
        assert run.generate([PROMPT], llm="sampler_full", max_new_tokens=1)[0][0]["policy_version"] == version


def test_a_generate_in_flight_finishes_on_the_weights_it_started_with(run):
    step(run, "learner", 10)
    run.sync_weights("learner", "sampler")
    old_version = run.generate([PROMPT], llm="sampler", max_new_tokens=1)[0][0]["policy_version"]
    old = run.generate([PROMPT], llm="sampler", max_new_tokens=8, seed=1)[0][0]
    for k in range(11, 14):  # three more steps: the sampler is three versions behind until the sync
        new_version = step(run, "learner", k)
    out = run.function("testkit.weight_sync:sync_between_two_generates", PROMPT, "learner", "sampler")
    assert out["before"] == (old_version, list(old["tokens"]))
    assert out["after"][0] == new_version == out["synced"]["policy_version"]
    new = run.generate([PROMPT], llm="learner", max_new_tokens=8, seed=1)[0][0]
    assert out["after"][1] == list(new["tokens"])  # the sampler now draws what the learner would


def test_a_sync_in_flight_reaches_the_batches_after_it_and_each_sample_says_its_version(run, gate):
    """The sampler, held busy, has a ``generate`` of eight prompts (one per decode batch) and then the sync queued:
    the call takes the new weights between two batches. Each prompt's tokens are what the weights of its version
    draw: the old adapter's (as read before) or the learner's."""
    prompts = [PROMPT, PROMPT[:3], [1, 88, 61], [1, 200, 17, 9], [1, 5, 77], [1, 142, 30, 8], [1, 64], [1, 19, 233]]
    greedy = {"max_new_tokens": 6, "do_sample": False, "minibatch_size": 1}
    step(run, "learner", 20)
    run.sync_weights("learner", "sampler")
    old = [(s[0]["policy_version"], list(s[0]["tokens"])) for s in run.generate(prompts, llm="sampler", **greedy)]
    for k in range(21, 24):
        new_version = step(run, "learner", k)
    new = [(new_version, list(s[0]["tokens"])) for s in run.generate(prompts, llm="learner", **greedy)]
    out = run.function("testkit.weight_sync:sync_in_flight", prompts, "learner", "sampler", gate)
    assert out["synced"]["policy_version"] == new_version
    versions = [version for version, _ in out["samples"]]
    assert new_version in versions, f"the write was not taken during the call: {versions}"
    taken = versions.index(new_version)  # the first prompt drawn from the new weights
    assert 1 <= taken and versions == [old[0][0]] * taken + [new_version] * (len(prompts) - taken), versions
    assert out["samples"] == old[:taken] + new[taken:]
    assert any(new[i][1] != old[i][1] for i in range(taken, len(prompts))), "the tokens must tell the versions apart"


def test_a_sync_the_sampler_cannot_take_is_refused_and_the_sampler_keeps_its_weights(run):
    before = run.state_dict(llm="sampler_full")
    with pytest.raises(Exception, match="trains"):
        run.sync_weights("learner", "full")
    with pytest.raises(Exception, match="unknown peft_adapter 'default' for LLM 'sampler_full'"):
        run.sync_weights("learner", "sampler_full")  # an adapter into a model without LoRA
    lora_before = run.state_dict(llm="sampler")
    with pytest.raises(Exception, match="tensors LLM 'sampler' does not hold"):
        run.sync_weights("full", "sampler")  # a whole model's tensors into one wrapped by PEFT
    assert_equal_states(run.state_dict(llm="sampler"), lora_before)
    alpha_before = run.state_dict(llm="sampler_alpha")
    with pytest.raises(Exception, match="LoRA scaling .* in LLM 'learner' and .* in LLM 'sampler_alpha'"):
        run.sync_weights("learner", "sampler_alpha")  # same names and shapes, another alpha / r
    assert_equal_states(run.state_dict(llm="sampler_alpha"), alpha_before)
    with pytest.raises(Exception, match="source and target are both"):
        run.sync_weights("sampler", "sampler")
    with pytest.raises(Exception, match="unknown llm 'nope'"):
        run.sync_weights("learner", "nope")
    with pytest.raises(Exception, match="via must be 'group'"):
        run.sync_weights("learner", "sampler", via="carrier pigeon")
    assert_equal_states(run.state_dict(llm="sampler_full"), before)
    assert run.generate([PROMPT], llm="sampler_full", max_new_tokens=2)[0][0]["tokens"] is not None


def test_closing_the_learner_right_after_an_async_sync_still_delivers_it(run):
    """``close_llm`` waits for the syncs its ranks still send (they go from the learner's leader, not the client).
    The module's last test: it closes ``full_one``."""
    step(run, "full_one", 30)
    out = run.function("testkit.weight_sync:sync_then_close", "full_one", "sampler_full")
    assert out["answer"]["tensors"] == out["shared"] > 0 and out["equal"], out
