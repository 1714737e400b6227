"""update(): one call on a fixed batch gives the parameters of a plain single-process PyTorch SGD step on
the whole batch (ZeRO 0-3, 1 and 2 replicas, tensor-parallel 2), accumulation is exact, frozen weights
stay put, gradient clipping clips, and replicas hold identical heads."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow

LR = 0.05
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café and", "東京 is",
            "x x x", "In the kitchen you see a fridge.", "pick up the key", "open the door"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" naïve", " über"], [" big"],
              [" c1", " c2", " c3"], [" open fridge", " go north"], [" now", " later"], [" slowly", " fast", "!"]]
ACTIONS = [1, 0, 1, 0, 2, 1, 0, 2]
WEIGHTS = [1.0, -0.5, 2.0, 0.3, -1.0, 0.7, 1.5, -0.2]
TARGETS = [0.5, -1.0, 2.0, 0.0, 1.0, -0.5, 0.25, 3.0]
BATCH = {"actions": ACTIONS, "weights": WEIGHTS, "targets": TARGETS}
UPDATER = {"plugin": "llmrl_test_plugins:ChosenScoreUpdater", "args": {"head": "value"}}


def llm(tiny, zero=0, replicas=1, micro=4, accumulation=2, **extra):
    config = {"model": tiny["llama"], "replicas": replicas, "heads": {"value": {"plugin": "value",
                                                                                "args": {"hidden": 16}}},
              "updater": UPDATER,
              "training": {"zero_stage": zero, "optimizer": {"type": "sgd", "lr": LR}, "micro_batch_size": micro,
                           "gradient_accumulation_steps": accumulation}}
    config.update(extra)
    return config


@pytest.fixture(scope="module")
def zero_run(tiny):
    from testkit import LiveRun

    llms = {f"z{z}r1": llm(tiny, z) for z in range(4)}
    llms.update({f"z{z}r2": llm(tiny, z, replicas=2, micro=2) for z in range(4)})
    run = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield run
    run.close()


@pytest.fixture(scope="module")
def misc_run(tiny):
    from testkit import LiveRun

    llms = {
        "tp2": llm(tiny, 1, tensor_parallel=2),
        "acc2x2": llm(tiny, 0, micro=2, accumulation=2),
        "acc4x1": llm(tiny, 0, micro=4, accumulation=1),
        "frozen": llm(tiny, 2, initializers=[{"plugin": "freeze", "args": {"unfreeze": ["model.layers.1.*"]}}]),
        "clipped": llm(tiny, 0, micro=8, accumulation=1),
    }
    llms["clipped"]["training"].update({"gradient_clipping": 1e-3, "optimizer": {"type": "sgd", "lr": 1.0}})
    run = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield run
    run.close()


def plain_sgd_step(tiny, state: dict, lr: float, n: int = len(CONTEXTS)) -> dict:
    """The reference: plain transformers + PyTorch, full forward per pair, one SGD step on the mean loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.plugins.contracts import LLMInfo
    from llmrl.plugins.value_head import ValueHead

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    info = LLMInfo("ref", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    head = ValueHead(info, hidden=16)
    head.load_state_dict({k[len("heads.value."):]: v for k, v in state.items() if k.startswith("heads.value.")})
    losses = []
    for i in range(n):
        context, candidate = CONTEXTS[i], CANDIDATES[i][ACTIONS[i]]
        ctx_ids, full = tok(context)["input_ids"], tok(context + candidate)["input_ids"]
        p = next((k for k, (a, b) in enumerate(zip(ctx_ids, full)) if a != b), min(len(ctx_ids), len(full)))
        out = model(input_ids=torch.tensor([full]), output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0], -1)
        score = sum(logp[t - 1, full[t]] for t in range(p, len(full)))
        hidden = model(input_ids=torch.tensor([ctx_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        losses.append(-WEIGHTS[i] * score + (head(_Outputs(hidden[None]))[0] - TARGETS[i]) ** 2)
    loss = torch.stack(losses).mean()
    named = {f"model.{k}": p for k, p in model.named_parameters()}
    named.update({f"heads.value.{k}": p for k, p in head.named_parameters()})
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {k: (p - lr * g if g is not None else p).detach() for (k, p), g in zip(named.items(), grads)}


class _Outputs:
    def __init__(self, hidden):
        self.context_hidden = hidden


def assert_params(after: dict, expected: dict, before: dict, atol=1e-5):
    changed = 0
    for key, value in expected.items():
        got = after[key]
        torch.testing.assert_close(got, value, atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        changed += int((value - before[key]).abs().max() > 1e-4)
    assert changed > len(expected) // 2, "the step should move most parameters"


def test_heads_start_identical_on_every_replica(zero_run):
    """Runs before any update (tests run in file order on the module's run)."""
    reference = zero_run.state_dict(llm="z0r1", prefix="heads.")
    assert reference and any(v.abs().sum() > 0 for v in reference.values())
    for name in ("z0r2", "z1r2", "z2r2"):
        for replica in (0, 1):
            heads = zero_run.state_dict(llm=name, prefix="heads.", replica=replica)
            assert heads.keys() == reference.keys()
            assert all(torch.equal(heads[k], reference[k]) for k in reference), (name, replica)


@pytest.mark.parametrize("name", [f"z{z}r{r}" for r in (1, 2) for z in range(4)])
def test_update_equals_a_plain_sgd_step(zero_run, tiny, name):
    before = zero_run.state_dict(llm=name)
    stats = zero_run.update(CONTEXTS, CANDIDATES, llm=name, **BATCH)
    replicas = int(name[-1])
    assert [s["replica"] for s in stats] == list(range(replicas))
    assert sorted(i for s in stats for i in s["indices"]) == list(range(len(CONTEXTS)))
    assert all(s["optimizer_steps"] == 1 for s in stats)
    assert_params(zero_run.state_dict(llm=name), plain_sgd_step(tiny, before, LR), before)


# Not z3r2: under ZeRO-3 the two replicas hold one partitioned copy of the weights (a shard each), so
# there are no two copies to compare; its parity with a single-process step is checked above.
@pytest.mark.parametrize("name", ["z0r2", "z1r2", "z2r2"])
def test_replicas_hold_identical_weights(zero_run, name):
    first, second = zero_run.state_dict(llm=name, replica=0), zero_run.state_dict(llm=name, replica=1)
    assert first.keys() == second.keys() and any(k.startswith("heads.value.") for k in first)
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_tensor_parallel_update_equals_a_plain_sgd_step(misc_run, tiny):
    before = misc_run.state_dict(llm="tp2")
    misc_run.update(CONTEXTS, CANDIDATES, llm="tp2", **BATCH)
    assert_params(misc_run.state_dict(llm="tp2"), plain_sgd_step(tiny, before, LR), before)


def test_micro_batch_2_x_accumulation_2_equals_4_x_1(misc_run):
    a = misc_run.update(CONTEXTS[:4], CANDIDATES[:4], llm="acc2x2", **{k: v[:4] for k, v in BATCH.items()})
    b = misc_run.update(CONTEXTS[:4], CANDIDATES[:4], llm="acc4x1", **{k: v[:4] for k, v in BATCH.items()})
    assert a[0]["micro_steps"] == 2 and b[0]["micro_steps"] == 1
    first, second = misc_run.state_dict(llm="acc2x2"), misc_run.state_dict(llm="acc4x1")
    for key in first:
        torch.testing.assert_close(first[key], second[key], atol=1e-6, rtol=0)


def test_frozen_parameters_do_not_move(misc_run):
    before = misc_run.state_dict(llm="frozen")
    misc_run.update(CONTEXTS, CANDIDATES, llm="frozen", **BATCH)
    after = misc_run.state_dict(llm="frozen")
    for key in before:
        moved = not torch.equal(before[key], after[key])
        trainable = key.startswith("model.model.layers.1.") or key.startswith("heads.")
        assert moved == trainable, key


def test_gradient_clipping_really_clips(misc_run, tiny):
    before = misc_run.state_dict(llm="clipped")
    misc_run.update(CONTEXTS, CANDIDATES, llm="clipped", **BATCH)
    after = misc_run.state_dict(llm="clipped")
    step = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))
    unclipped = plain_sgd_step(tiny, before, 1.0)
    full = math.sqrt(sum(float(((unclipped[k] - before[k]) ** 2).sum()) for k in unclipped))
    assert full > 0.1, "the unclipped step must be far larger than the clip"
    assert step == pytest.approx(1e-3, rel=0.02)  # lr 1 x the clip norm
