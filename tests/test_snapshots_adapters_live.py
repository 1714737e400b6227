"""Named weight snapshots and adapters created at run time, against plain PEFT models.

A snapshot scores and generates like a plain model holding the weights it froze, after further steps of its
source, and again after it is taken anew under the same name (the cache across calls must forget its keys); an
adapter created with ``create_adapter`` starts equal to a config-declared one of the same configuration and seed
and trains the same, while the adapter beside it stays bit-identical. A model trained without LoRA snapshots its
trained weights (under ZeRO-3, each rank its partitions). Snapshots and created adapters survive save and resume,
and past the LLM's cap are refused by name. Misuse is refused naming the cause; a step that would leave an adapter
non-finite is undone; the next save removes what a save killed half-way left.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.plain import lora_weights, plain_full_model, plain_model, plain_scores

pytestmark = pytest.mark.slow

LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
CONTEXTS = [[5, 17, 33, 8], [40, 41, 42], [9, 9, 10, 11, 12]]
CANDIDATES = [[[60, 61], [62]], [[7, 8, 9]], [[70], [71, 72], [73]]]


def config(tiny, checkpoint: str | None = None, skip=()) -> dict:
    trained = {"model": tiny["llama"], "initializers": [LORA], "trainable": True,
               "training": {"optimizer": {"type": "adam", "lr": 1e-3}}}
    llms = {"policy": {**trained, "replicas": 2, "kv_cache_mb": 8},
            "declared": {**trained, "initializers": [{"plugin": "lora", "args": {"adapters": {"x": {"r": 4}}}}],
                         "max_run_time_adapters": 1},
            "z2": {**trained, "training": {"zero_stage": 2, "optimizer": {"type": "adam", "lr": 1e-3}},
                   "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}, "b": {"r": 4}}}}]}}
    full = {**trained, "initializers": []}  # every weight trained: a snapshot copies them all (ZeRO-3: each rank's
    adam = {"optimizer": {"type": "adam", "lr": 1e-4}}  # partitions; over 2 replicas layer by layer, on 1 gathered)
    llms.update(full={**full, "training": {"zero_stage": 2, **adam}}, full3g={**full, "training": {"zero_stage": 3,
                **adam}}, full3={**full, "replicas": 2, "training": {"zero_stage": 3, "zero3_gather_mb": 0, **adam}},
                z3={**trained, "replicas": 2, "training": {"zero_stage": 3, **adam}})  # LoRA under ZeRO-3
    for llm in llms.values():
        llm["checkpoint"] = checkpoint
    return {"llms": {k: v for k, v in llms.items() if k not in skip}, "threads_per_rank": 1}


@pytest.fixture(scope="module")
def run(tiny):
    live = LiveRun(config(tiny))
    yield live
    assert live.close() == 0


def train_steps(run, llm: str, steps: int, adapter: str | None = None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(3, 100, (9,), generator=g).tolist()
        datum = {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:],
                                                                "weights": torch.rand(8, generator=g).tolist()}}
        run.forward_backward([datum, datum], "cross_entropy", llm=llm, peft_adapter=adapter)
        run.optim_step({"learning_rate": 5e-3}, llm=llm)


def assert_scores(got, want) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_snapshot_reads_like_a_plain_model_holding_its_weights_while_training_goes_on(run, tiny):
    train_steps(run, "policy", 1, seed=1)  # the adapter's B is no longer zero: snapshots differ from the base model
    frozen = run.state_dict(llm="policy")
    assert run.snapshot("before", llm="policy")["source"] == "default"
    run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="before")  # fills the cache under "before"
    train_steps(run, "policy", 2, seed=2)
    now = run.state_dict(llm="policy")
    then_model = plain_model(tiny, lora_weights(frozen, "default"))
    now_model = plain_model(tiny, lora_weights(now, "default"))
    assert_scores(run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="before"),
                  plain_scores(then_model, CONTEXTS, CANDIDATES))
    assert_scores(run.score(CONTEXTS, CANDIDATES, llm="policy"), plain_scores(now_model, CONTEXTS, CANDIDATES))
    (sample,), = run.generate([CONTEXTS[0]], llm="policy", peft_adapter="before", max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = then_model.generate(input_ids=torch.tensor([CONTEXTS[0]]), max_new_tokens=6, do_sample=False)
    assert sample["tokens"].tolist() == want[0, len(CONTEXTS[0]):].tolist()[:len(sample["tokens"])]
    datum = {"model_input": CONTEXTS[1] + [7, 8], "loss_fn_inputs": {"target_tokens": CONTEXTS[1][1:] + [7, 8, 9]}}
    out = run.forward([datum], llm="policy", peft_adapter="before")
    torch.testing.assert_close(out["loss_fn_outputs"][0]["logprobs"][-3:].sum(),
                               plain_scores(then_model, [CONTEXTS[1]], [[[7, 8, 9]]])[0][0], atol=1e-5, rtol=1e-5)
    # a snapshot of a snapshot copies the snapshot's weights, not its source's
    run.snapshot("before_copy", llm="policy", peft_adapter="before")
    assert_scores(run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="before_copy"),
                  plain_scores(then_model, CONTEXTS, CANDIDATES))
    run.drop_snapshot("before_copy", llm="policy")
    # taken anew under the same name: the newest weights, and none of the keys cached under the old ones
    run.snapshot("before", llm="policy")
    assert_scores(run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="before"),
                  plain_scores(now_model, CONTEXTS, CANDIDATES))
    memory = run.server_memory()
    reports = [m for m in memory.values() if "snapshots" in m]
    assert len(reports) == 2 and all(m["snapshots"]["before"]["source"] == "default" for m in reports)
    run.drop_snapshot("before", llm="policy")
    with pytest.raises(Exception, match="unknown peft_adapter 'before'"):
        run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="before")


def test_snapshots_under_zero_2_and_frozen_to_training(run, tiny):
    train_steps(run, "z2", 1, seed=3)
    frozen = run.state_dict(llm="z2")
    run.snapshot("ref", llm="z2")
    with pytest.raises(Exception, match="'ref' is a snapshot"):
        train_steps(run, "z2", 1, adapter="ref")
    train_steps(run, "z2", 2, seed=4)
    assert_scores(run.score(CONTEXTS, CANDIDATES, llm="z2", peft_adapter="ref"),
                  plain_scores(plain_model(tiny, lora_weights(frozen, "default")), CONTEXTS, CANDIDATES))
    with pytest.raises(Exception, match="a trained adapter"):
        run.snapshot("default", llm="z2")
    run.create_adapter("new", llm="z2")  # under ZeRO-2 with an optimizer of its own (test_run_time_adapters_live)
    run.delete_adapter("new", llm="z2")


@pytest.mark.parametrize("llm", ["full", "full3", "full3g"])
def test_a_model_trained_without_lora_snapshots_its_weights(run, tiny, llm):
    train_steps(run, llm, 1, seed=11)
    frozen = run.state_dict(llm=llm)
    assert run.snapshot("ref", llm=llm)["source"] is None
    train_steps(run, llm, 2, seed=12)
    now = run.state_dict(llm=llm)
    assert max(float((now[k] - frozen[k]).abs().max()) for k in now) > 1e-4
    for _ in range(2):  # reading the snapshot leaves the trained weights (and, under ZeRO-3, their gathers) alone
        assert_scores(run.score(CONTEXTS, CANDIDATES, llm=llm, peft_adapter="ref"),
                      plain_scores(plain_full_model(tiny, frozen), CONTEXTS, CANDIDATES))
        assert_scores(run.score(CONTEXTS, CANDIDATES, llm=llm),  # the trained weights are back in place
                      plain_scores(plain_full_model(tiny, now), CONTEXTS, CANDIDATES))
    (sample,), = run.generate([CONTEXTS[0]], llm=llm, peft_adapter="ref", max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = plain_full_model(tiny, frozen).generate(input_ids=torch.tensor([CONTEXTS[0]]), max_new_tokens=6,
                                                       do_sample=False)
    assert sample["tokens"].tolist() == want[0, len(CONTEXTS[0]):].tolist()
    with pytest.raises(Exception, match="'ref' is a snapshot"):
        train_steps(run, llm, 1, adapter="ref")
    with pytest.raises(Exception, match="has no LoRA adapter"):
        run.snapshot("other", llm=llm, peft_adapter="default")


def test_an_adapter_created_at_run_time_equals_a_declared_one_and_trains_alone(run):
    run.create_adapter("x", rank=4, seed=0, llm="policy")  # the config's seed is 0, as "declared"'s adapter x had
    declared = lora_weights(run.state_dict(llm="declared"), "x")
    before = run.state_dict(llm="policy")
    created = lora_weights(before, "x")
    assert created.keys() == declared.keys()
    for key in declared:
        torch.testing.assert_close(created[key], declared[key], atol=0, rtol=0)
    train_steps(run, "policy", 3, adapter="x", seed=5)
    train_steps(run, "declared", 3, seed=5)
    after = run.state_dict(llm="policy")
    trained, want = lora_weights(after, "x"), lora_weights(run.state_dict(llm="declared"), "x")
    moved = sum(int((trained[k] - created[k]).abs().max() > 1e-4) for k in want)
    assert moved >= len(want) // 2
    for key in want:
        torch.testing.assert_close(trained[key], want[key], atol=1e-5, rtol=0)
    for key, value in lora_weights(before, "default").items():  # the other adapter: bit-identical
        torch.testing.assert_close(lora_weights(after, "default")[key], value, atol=0, rtol=0)
    with pytest.raises(Exception, match="refused by llmrl's rule for adapter names"):
        run.create_adapter("lora_x", llm="policy")
    with pytest.raises(Exception, match="not an adapter created at run time"):
        run.delete_adapter("default", llm="policy")
    run.delete_adapter("x", llm="policy")
    assert not any(".x." in k for k in run.state_dict(llm="policy"))
    with pytest.raises(Exception, match="unknown peft_adapter 'x'"):
        run.score(CONTEXTS, CANDIDATES, llm="policy", peft_adapter="x")


def test_past_its_cap_an_adapter_or_snapshot_is_refused_by_name_and_a_freed_place_serves_the_next(run):
    """``max_run_time_adapters: 1`` on LLM ``declared``: a second adapter or a snapshot is refused naming the cap,
    the LLM goes on serving, and a deleted adapter frees its place. Names PEFT treats specially are refused too."""
    run.create_adapter("one", rank=2, llm="declared")
    with pytest.raises(Exception, match=r"adapter 'two' is refused: LLM 'declared' holds 1 adapters created at "
                                        r"run time and snapshots \(one\), its cap \(llms.declared.max_run_time_"
                                        r"adapters: 1"):
        run.create_adapter("two", rank=2, llm="declared")
    with pytest.raises(Exception, match=r"snapshot 'ref' is refused: LLM 'declared' holds 1"):
        run.snapshot("ref", llm="declared", peft_adapter="x")
    assert len(run.score(CONTEXTS, CANDIDATES, llm="declared", peft_adapter="one")) == len(CONTEXTS)
    run.delete_adapter("one", llm="declared")
    assert run.snapshot("ref", llm="declared", peft_adapter="x")["snapshot"] == "ref"
    run.drop_snapshot("ref", llm="declared")
    for name in ("a", "lo", "update", "keys", "to"):
        with pytest.raises(Exception, match=f"'{name}' is refused by llmrl's rule for adapter names: it must not be"):
            run.create_adapter(name, llm="policy")


def test_created_adapters_and_snapshots_are_saved_and_made_again_on_resume(run, tiny, tmp_path):
    run.create_adapter("y", rank=2, seed=7, targets=["attention", "unembed"], llm="policy")
    train_steps(run, "policy", 2, adapter="y", seed=8)
    run.snapshot("y_then", llm="policy", peft_adapter="y")
    train_steps(run, "policy", 1, adapter="y", seed=9)
    keys = [k for k in run.state_dict(llm="policy") if ".lora_A.y." in k]
    assert any("lm_head" in k for k in keys) and any("self_attn.q_proj" in k for k in keys)  # layers already adapted
    assert not any("mlp" in k for k in keys)  # by "default" count as their linear layers; the MLP is not a target
    run.forward_backward([{"model_input": [5, 6], "loss_fn_inputs": {"target_tokens": [6, 7], "weights": [1, 1]}}],
                         "cross_entropy", llm="policy", peft_adapter="y")
    with pytest.raises(Exception, match=r"call optim_step\(\) before save"):
        run.save(str(tmp_path / "refused"))
    run.optim_step(llm="policy")
    path = str(tmp_path / "checkpoint")
    run.save(path)

    def versions(live) -> dict:
        return {adapter: live.generate(["a"], llm="policy", peft_adapter=adapter, max_new_tokens=1)[0][0]
                ["policy_version"] for adapter in ("y", "y_then")}

    assert versions(run) == {"y": 4, "y_then": 2}  # 2 + 1 updates + 1 optim_step; the snapshot's, when taken
    with LiveRun(config(tiny, checkpoint=path, skip=("full3g", "z3"))) as resumed:  # those it does not compare
        assert versions(resumed) == {"y": 4, "y_then": 2}  # the policy versions go on from the checkpoint's
        for llm in ("policy", "z2", "full", "full3"):
            saved, loaded = run.state_dict(llm=llm), resumed.state_dict(llm=llm)
            assert saved.keys() == loaded.keys()
            for key in saved:
                torch.testing.assert_close(loaded[key], saved[key], atol=0, rtol=0)
        for llm, snapshot in (("policy", "y_then"), ("full", "ref"), ("full3", "ref")):
            assert_scores(resumed.score(CONTEXTS, CANDIDATES, llm=llm, peft_adapter=snapshot),
                          run.score(CONTEXTS, CANDIDATES, llm=llm, peft_adapter=snapshot))
        for live in (run, resumed):  # the optimizer's moments of the created adapter came back too
            train_steps(live, "policy", 1, adapter="y", seed=10)
        after, want = resumed.state_dict(llm="policy"), run.state_dict(llm="policy")
        for key in want:
            torch.testing.assert_close(after[key], want[key], atol=1e-6, rtol=0)


def test_one_adapters_state_saved_and_loaded_into_new_adapters_trains_on_as_the_original(run, tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run.create_adapter("s", rank=2, seed=3, targets=["attention"], llm="policy")
    train_steps(run, "policy", 2, adapter="s", seed=11)
    saved = run.save_adapter(tmp_path / "s", llm="policy", peft_adapter="s")
    assert saved["optimizer_state"] and saved["adapter"] == "s"
    with pytest.raises(Exception, match="exists; save_adapter writes a new folder"):
        run.save_adapter(tmp_path / "s", llm="policy", peft_adapter="s")
    with pytest.raises(Exception, match=r"declared in the config"):  # ZeRO-2 keeps its moments in flat partitions
        run.save_adapter(tmp_path / "z2", llm="z2")
    run.load_adapter(tmp_path / "s", "s_copy", llm="policy")
    run.load_adapter(tmp_path / "s", "s_fresh", optimizer=False, llm="policy")
    state = run.state_dict(llm="policy")
    original = lora_weights(state, "s")
    assert len(original) > 4
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["llama"]), tmp_path / "s" / "peft")
    exported = {k: v for k, v in plain.state_dict().items() if "lora_" in k}
    assert exported.keys() == original.keys()  # plain PEFT reads the saved folder
    for copy in ("s_copy", "s_fresh"):
        loaded = lora_weights(state, copy)
        for key in original:
            torch.testing.assert_close(loaded[key], original[key], atol=0, rtol=0)
            torch.testing.assert_close(exported[key], original[key], atol=0, rtol=0)
    for name in ("s", "s_copy", "s_fresh"):
        train_steps(run, "policy", 1, adapter=name, seed=12)
    after = run.state_dict(llm="policy")
    trained, copy, fresh = (lora_weights(after, name) for name in ("s", "s_copy", "s_fresh"))
    for key in trained:  # the saved Adam moments came along: the same step
        torch.testing.assert_close(copy[key], trained[key], atol=1e-6, rtol=0)
    assert max(float((fresh[k] - trained[k]).abs().max()) for k in trained) > 1e-4  # fresh moments: another step
    with pytest.raises(Exception, match="another adapter shape"):
        run.load_adapter(tmp_path / "s", "default", llm="policy")  # rank 4 on every linear layer
    run.create_adapter("s_alpha", rank=2, alpha=8, seed=3, targets=["attention"], llm="policy")  # the same shapes
    with pytest.raises(Exception, match=r"LoRA scaling \(alpha / r\) differs from 's_alpha'.*saved 2.0, here 4.0"):
        run.load_adapter(tmp_path / "s", "s_alpha", llm="policy")
    for name in ("s", "s_copy", "s_fresh", "s_alpha"):
        run.delete_adapter(name, llm="policy")


def datum_of(seed: int, sampler: float | None = None) -> dict:
    """A datum of random tokens; with ``sampler``, importance-sampling inputs whose sampler log-probs are that value
    (-200: the ratio overflows, the loss is not finite and the call fails on the servers)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 100, (9,), generator=g).tolist()
    inputs = {"target_tokens": tokens[1:], "weights": torch.rand(8, generator=g).tolist()}
    if sampler is not None:
        inputs = {"target_tokens": tokens[1:], "advantages": [1.0] * 8, "logprobs": [sampler] * 8}
    return {"model_input": tokens[:-1], "loss_fn_inputs": inputs}


@pytest.mark.parametrize("llm", ["policy", "z3"])
def test_adapters_trained_in_turn_step_apart_and_a_failed_call_keeps_the_others_gradients(run, llm):
    """Two Tinker training clients are two adapters of one model. Under ZeRO 0 in float32 (gradients on the
    parameters), and under ZeRO-3 (adapters created at run time step with optimizers of their own), A.fb, B.fb,
    A.step, B.step equals each trained alone, and B's failed call leaves A's pending gradients to A's step. (A
    failure on B wiped A's gradients, and A's step then reported success with nothing to apply; optim_step(A) was
    refused for good while B's were pending.)"""
    for name in ("ta", "tb", "alone_a", "alone_b"):
        run.create_adapter(name, rank=4, seed=9, llm=llm)  # one seed: every adapter starts the same
    run.forward_backward([datum_of(1)], "cross_entropy", llm=llm, peft_adapter="ta")
    run.forward_backward([datum_of(2)], "cross_entropy", llm=llm, peft_adapter="tb")
    assert run.optim_step({"learning_rate": 5e-3}, llm=llm, peft_adapter="ta")["adapters"] == ["ta"]
    run.forward_backward([datum_of(3)], "cross_entropy", llm=llm, peft_adapter="ta")  # pending while b steps
    assert run.optim_step({"learning_rate": 5e-3}, llm=llm, peft_adapter="tb")["adapters"] == ["tb"]
    with pytest.raises(Exception, match="loss of backward call 1 was not finite") as info:
        run.forward_backward([datum_of(4, sampler=-200.0)], "importance_sampling", llm=llm, peft_adapter="tb")
    assert "those of ['ta'] are kept" in str(info.value)
    assert run.optim_step({"learning_rate": 5e-3}, llm=llm, peft_adapter="ta")["optimizer_steps"] == 1
    for adapter, seeds in (("alone_a", (1, 3)), ("alone_b", (2,))):
        for seed in seeds:
            run.forward_backward([datum_of(seed)], "cross_entropy", llm=llm, peft_adapter=adapter)
            run.optim_step({"learning_rate": 5e-3}, llm=llm, peft_adapter=adapter)
    state = run.state_dict(llm=llm)
    for adapter, alone in (("ta", "alone_a"), ("tb", "alone_b")):
        got, want = lora_weights(state, adapter), lora_weights(state, alone)
        assert got.keys() == want.keys() and any(float(want[k].abs().max()) > 0 for k in want if "lora_B" in k)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    for name in ("ta", "tb", "alone_a", "alone_b"):
        run.delete_adapter(name, llm=llm)


def test_under_zero_2_an_adapter_whose_gradients_another_call_discarded_is_told(run):
    """ZeRO 1-3 hold every adapter's gradients in one buffer: a failure on B discards A's too, and A's next call says
    so (once) instead of stepping nothing as if all were well; A's step is refused while B's gradients wait."""
    run.forward_backward([datum_of(1)], "cross_entropy", llm="z2", peft_adapter="default")
    run.forward_backward([datum_of(2)], "cross_entropy", llm="z2", peft_adapter="b")
    with pytest.raises(Exception, match=r"would also step adapter\(s\) \['b'\]"):
        run.optim_step({"learning_rate": 5e-3}, llm="z2", peft_adapter="default")
    assert run.optim_step({"learning_rate": 5e-3}, llm="z2")["adapters"] == ["b", "default"]
    run.forward_backward([datum_of(3)], "cross_entropy", llm="z2", peft_adapter="default")
    with pytest.raises(Exception, match="not finite"):
        run.forward_backward([datum_of(4, sampler=-200.0)], "importance_sampling", llm="z2", peft_adapter="b")
    before = run.state_dict(llm="z2")
    with pytest.raises(Exception, match="adapter 'default''s 1 forward_backward call.* were discarded when a call "
                                        "on adapter 'b' failed"):
        run.optim_step({"learning_rate": 5e-3}, llm="z2", peft_adapter="default")
    told_once = run.optim_step({"learning_rate": 5e-3}, llm="z2", peft_adapter="default")
    assert told_once["optimizer_steps"] == 0
    after = run.state_dict(llm="z2")
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_step_that_would_leave_an_adapter_non_finite_is_undone_and_every_adapter_trains_on(run):
    """Adam adds ``weight_decay * w`` to the gradient: at 1e30 its square overflows the second moment. The step is
    refused after it was taken, undone on both replicas (weights, moments, step counts: the adapter's next step equals
    its twin's, which never saw it), and the other adapter's pending gradients and training go on."""
    names = ("bad", "bad_twin", "other", "other_twin")
    for name in names:
        run.create_adapter(name, rank=4, seed=9, llm="policy")
    for name in ("bad", "bad_twin"):
        run.forward_backward([datum_of(1)], "cross_entropy", llm="policy", peft_adapter=name)
        run.optim_step({"learning_rate": 5e-3}, llm="policy", peft_adapter=name)  # moments and a step count
    run.forward_backward([datum_of(2)], "cross_entropy", llm="policy", peft_adapter="other")  # pending meanwhile
    run.forward_backward([datum_of(3)], "cross_entropy", llm="policy", peft_adapter="bad")
    before = run.state_dict(llm="policy")
    with pytest.raises(Exception, match=r"optimizer step 1 left a value that is not finite on replica 0 \(adapter "
                                        r"'bad''s optimizer state exp_avg_sq .*: inf\): the step was undone on every "
                                        r"replica \(adapter\(s\) \['bad'\] hold the weights and optimizer moments of "
                                        r"before it\).*those of \['other'\] are kept"):
        run.optim_step({"learning_rate": 5e-3, "weight_decay": 1e30}, llm="policy", peft_adapter="bad")
    after = run.state_dict(llm="policy")
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert run.optim_step({"learning_rate": 5e-3}, llm="policy", peft_adapter="other")["adapters"] == ["other"]
    run.forward_backward([datum_of(2)], "cross_entropy", llm="policy", peft_adapter="other_twin")
    run.optim_step({"learning_rate": 5e-3}, llm="policy", peft_adapter="other_twin")
    for name in ("bad", "bad_twin"):
        run.forward_backward([datum_of(4)], "cross_entropy", llm="policy", peft_adapter=name)
        run.optim_step({"learning_rate": 5e-3}, llm="policy", peft_adapter=name)
    state = run.state_dict(llm="policy")
    for adapter, twin in (("bad", "bad_twin"), ("other", "other_twin")):
        got, want = lora_weights(state, adapter), lora_weights(state, twin)
        assert any(float(want[k].abs().max()) > 0 for k in want if "lora_B" in k)
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    for name in names:
        run.delete_adapter(name, llm="policy")


def test_under_zero_2_a_step_that_would_leave_non_finite_moments_is_undone(run):
    """Under ZeRO 2 the optimizer steps DeepSpeed's float32 partitions, copied to the model's weights after: both
    are put back."""
    train_steps(run, "z2", 1, seed=13)
    run.forward_backward([datum_of(5)], "cross_entropy", llm="z2")
    before = run.state_dict(llm="z2")
    with pytest.raises(Exception, match=r"not finite .*: the step was undone on every replica \(adapter\(s\) "
                                        r"\['default'\]"):
        run.optim_step({"learning_rate": 5e-3, "weight_decay": 1e30}, llm="z2")
    after = run.state_dict(llm="z2")
    assert all(torch.equal(after[k], before[k]) for k in before)
    train_steps(run, "z2", 1, seed=14)
    moved = run.state_dict(llm="z2")
    assert all(bool(torch.isfinite(v).all()) for v in moved.values())
    assert any(not torch.equal(moved[k], after[k]) for k in after)


def test_the_next_save_removes_the_staging_folder_a_killed_save_left_and_nothing_else(run, tmp_path):
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale, other = tmp_path / f".old.partial-{ended.pid}", tmp_path / f".notes.partial-{ended.pid}"
    for folder in (stale, other):  # as a save killed half-way leaves it; and a folder that only looks like one
        (folder / "peft").mkdir(parents=True)
        (folder / "adapter_state.pt").write_bytes(b"half")
    (other / "notes.txt").write_text("not written by save_adapter")
    run.create_adapter("u", rank=2, seed=3, targets=["attention"], llm="policy")
    run.save_adapter(tmp_path / "u", llm="policy", peft_adapter="u")
    assert not stale.exists() and (other / "notes.txt").is_file() and (tmp_path / "u" / "adapter_state.pt").is_file()
    run.delete_adapter("u", llm="policy")
