"""update() against plain single-process PyTorch on the whole batch: three consecutive Adam and AdamW steps (non-
default betas, eps, weight decay) under ZeRO 0-3 with 1 and 2 replicas (each optimizer with every stage and both
replica counts), and tensor-parallel 2 with 2 replicas;
SGD with accumulation, uneven shares, a replica with no sample and a short last accumulation group (every
sample of a step weighs the same, nothing leaks into the next update); frozen weights stay put, clipping clips,
replicas stay equal; a
token-level loss (per-token log-probs and entropies from ``trainer.forward(per_token=True)``, candidates given
as token ids and as text) under ZeRO-2 and ZeRO-3 with 2 replicas equals a plain SGD step.

LoRA adapters trained in turn are in test_adapter_isolation_live.py.

Tolerances: 2e-5 absolute on parameters after Adam/AdamW steps at lr 1e-3, 1e-5 after SGD steps; every test also checks
that most parameters moved by far more (1e-3 and more)."""

from __future__ import annotations

import math

import pytest
import torch

from testkit import LiveRun

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
ADAM = {"type": "adam", "lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.01}
# eps is kept away from the gradients' scale: with eps far below a gradient that is nearly zero, Adam's update of
# that weight is m / sqrt(v) and swings with rounding in the gradient (a test of the engine, not of float noise).
ADAMW = {"type": "adamw", "lr": 1e-3, "betas": [0.85, 0.9], "eps": 1e-5, "weight_decay": 0.1}


def llm(tiny, zero=0, replicas=1, micro=4, accumulation=2, optimizer=None, **extra):
    config = {"model": tiny["llama"], "replicas": replicas, "heads": {"value": {"plugin": "value",
                                                                                "args": {"hidden": 16}}},
              "updater": UPDATER,
              "training": {"zero_stage": zero, "optimizer": optimizer or {"type": "sgd", "lr": LR},
                           "micro_batch_size": micro, "gradient_accumulation_steps": accumulation}}
    config.update(extra)
    return config


# Each optimizer meets every ZeRO stage and both replica counts, and each ZeRO stage both replica counts (a covering
# design: half the 16 combinations, so that the run starts 12 ranks instead of 24).
ZERO_LAYOUTS = {"adam-z0r1": ADAM, "adam-z1r2": ADAM, "adam-z2r1": ADAM, "adam-z3r2": ADAM,
                "adamw-z0r2": ADAMW, "adamw-z1r1": ADAMW, "adamw-z2r2": ADAMW, "adamw-z3r1": ADAMW}


@pytest.fixture(scope="module")
def zero_run(tiny):
    """Adam and AdamW, ZeRO 0-3, 1 and 2 replicas (accumulation 2 in every layout)."""
    llms = {}
    for name, optimizer in ZERO_LAYOUTS.items():
        zero, replicas = int(name[-3]), int(name[-1])
        llms[name] = llm(tiny, zero, replicas=replicas, micro=4 // replicas, optimizer=optimizer)
    run = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield run
    assert run.close() == 0


@pytest.fixture(scope="module")
def misc_run(tiny):
    llms = {
        "tp2r2": llm(tiny, 1, replicas=2, micro=2, tensor_parallel=2, optimizer=ADAM),
        "acc2x2": llm(tiny, 0, micro=2, accumulation=2),
        "acc4x1": llm(tiny, 0, micro=4, accumulation=1),
        "uneven-z2": llm(tiny, 2, replicas=2, micro=2, accumulation=2),
        "uneven-z3": llm(tiny, 3, replicas=2, micro=2, accumulation=2),
        "short": llm(tiny, 0, micro=2, accumulation=2),
        "frozen": llm(tiny, 2, initializers=[{"plugin": "freeze", "args": {"unfreeze": ["model.layers.1.*"]}}]),
        "clipped": llm(tiny, 0, micro=8, accumulation=1),
    }
    llms["clipped"]["training"].update({"gradient_clipping": 1e-3, "optimizer": {"type": "sgd", "lr": 1.0}})
    run = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield run
    assert run.close() == 0


# ----------------------------------------------------------------------------- the plain reference


class _Outputs:
    def __init__(self, hidden):
        self.context_hidden = hidden


def _score(model, tok, context, candidate, hidden=False):
    ctx_ids, full = tok(context)["input_ids"], tok(context + candidate)["input_ids"]
    p = next((k for k, (a, b) in enumerate(zip(ctx_ids, full)) if a != b), min(len(ctx_ids), len(full)))
    assert 0 < p < len(full), "the reference needs a conditioned candidate"
    logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0], -1)
    score = sum(logp[t - 1, full[t]] for t in range(p, len(full)))
    if not hidden:
        return score, None
    out = model(input_ids=torch.tensor([ctx_ids]), output_hidden_states=True)
    return score, out.hidden_states[-1][0, -1]


def reference_training(tiny, state: dict, steps: list[list[int]], optimizer: dict | None = None,
                       batch: dict = BATCH, head: bool = True) -> dict:
    """Plain transformers + PyTorch: for each group of sample indices, one optimizer step on the mean loss of its
    samples (loss_i = -w_i log p(a_i | c_i) + (V(c_i) - t_i)^2). Returns the parameters after the last step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.plugins.contracts import LLMInfo
    from llmrl.plugins.value_head import ValueHead

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    named = {f"model.{k}": p for k, p in model.named_parameters()}
    value_head = None
    if head:
        info = LLMInfo("ref", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                       torch.device("cpu"))
        value_head = ValueHead(info, hidden=16)
        value_head.load_state_dict({k[len("heads.value."):]: v for k, v in state.items()
                                    if k.startswith("heads.value.")})
        named.update({f"heads.value.{k}": p for k, p in value_head.named_parameters()})
    opt = make_optimizer(list(named.values()), optimizer or {"type": "sgd", "lr": LR})
    for group in steps:
        opt.zero_grad()
        losses = []
        for i in group:
            score, hidden = _score(model, tok, CONTEXTS[i], CANDIDATES[i][batch["actions"][i]], hidden=head)
            loss = -batch["weights"][i] * score
            if head:
                loss = loss + (value_head(_Outputs(hidden[None]))[0] - batch["targets"][i]) ** 2
            losses.append(loss)
        torch.stack(losses).mean().backward()
        opt.step()
    return {k: p.detach().clone() for k, p in named.items()}


def make_optimizer(params, spec: dict):
    kind = spec["type"]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"])
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    return cls(params, lr=spec["lr"], betas=tuple(spec.get("betas", (0.9, 0.999))), eps=spec.get("eps", 1e-8),
               weight_decay=spec.get("weight_decay", 0.0))


def plain_sgd_step(tiny, state: dict, lr: float, n: int = len(CONTEXTS)) -> dict:
    """One plain SGD step on the mean loss of the first ``n`` samples."""
    return reference_training(tiny, state, [list(range(n))], {"type": "sgd", "lr": lr})


def assert_params(after: dict, expected: dict, before: dict, atol=1e-5, moved_by=1e-4):
    changed = 0
    for key, value in expected.items():
        got = after[key]
        torch.testing.assert_close(got, value, atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        changed += int((value - before[key]).abs().max() > moved_by)
    assert changed > len(expected) // 2, "the step should move most parameters by far more than the tolerance"


# ----------------------------------------------------------------------------- tests


def test_heads_start_identical_on_every_replica(tiny):
    """Heads are built from the same seed on every replica (each run builds them anew)."""
    run = LiveRun({"llms": {"r1": llm(tiny), "r2": llm(tiny, 2, replicas=2)}, "threads_per_rank": 1})
    try:
        reference = run.state_dict(llm="r1", prefix="heads.")
        assert reference and any(v.abs().sum() > 0 for v in reference.values())
        for replica in (0, 1):
            heads = run.state_dict(llm="r2", prefix="heads.", replica=replica)
            assert heads.keys() == reference.keys()
            assert all(torch.equal(heads[k], reference[k]) for k in reference), replica
    finally:
        assert run.close() == 0


@pytest.mark.parametrize("name", list(ZERO_LAYOUTS))
def test_three_updates_equal_three_plain_optimizer_steps(zero_run, tiny, name):
    before = zero_run.state_dict(llm=name)
    for _ in range(3):
        stats = zero_run.update(CONTEXTS, CANDIDATES, llm=name, **BATCH)
        assert all(s["optimizer_steps"] == 1 for s in stats)
    replicas = int(name[-1])
    assert [s["replica"] for s in stats] == list(range(replicas))
    assert sorted(i for s in stats for i in s["indices"]) == list(range(len(CONTEXTS)))
    expected = reference_training(tiny, before, [list(range(8))] * 3, ZERO_LAYOUTS[name])
    assert_params(zero_run.state_dict(llm=name), expected, before, atol=2e-5, moved_by=1e-3)
    if replicas == 2 and not name.endswith("z3r2"):  # ZeRO-3's replicas hold one partitioned copy
        first, second = (zero_run.state_dict(llm=name, replica=r) for r in (0, 1))
        assert all(torch.equal(first[k], second[k]) for k in first)


def test_tensor_parallel_with_two_replicas_equals_plain_adam(misc_run, tiny):
    before = misc_run.state_dict(llm="tp2r2")
    for _ in range(3):
        misc_run.update(CONTEXTS, CANDIDATES, llm="tp2r2", **BATCH)
    expected = reference_training(tiny, before, [list(range(8))] * 3, ADAM)
    assert_params(misc_run.state_dict(llm="tp2r2"), expected, before, atol=2e-5, moved_by=1e-3)


def test_micro_batch_2_x_accumulation_2_equals_4_x_1(misc_run):
    a = misc_run.update(CONTEXTS[:4], CANDIDATES[:4], llm="acc2x2", **{k: v[:4] for k, v in BATCH.items()})
    b = misc_run.update(CONTEXTS[:4], CANDIDATES[:4], llm="acc4x1", **{k: v[:4] for k, v in BATCH.items()})
    assert a[0]["micro_steps"] == 2 and b[0]["micro_steps"] == 1
    first, second = misc_run.state_dict(llm="acc2x2"), misc_run.state_dict(llm="acc4x1")
    for key in first:
        torch.testing.assert_close(first[key], second[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["uneven-z2", "uneven-z3"])
def test_uneven_shares_weigh_every_sample_equally(misc_run, tiny, name):
    """7 samples over 2 replicas (shares 4 and 3, a short last micro-batch), then 1 sample (a replica with none):
    each update is one step on the mean loss of its samples, and nothing carries into the next update. (The
    replicas' forward passes differ in shape: ZeRO-2's and ZeRO-3's gradient reductions must not care.)"""
    batch7 = {k: v[:7] for k, v in BATCH.items()}
    before = misc_run.state_dict(llm=name)
    stats = misc_run.update(CONTEXTS[:7], CANDIDATES[:7], llm=name, **batch7)
    assert [len(s["indices"]) for s in stats] == [4, 3] and [s["optimizer_steps"] for s in stats] == [1, 1]
    stats = misc_run.update(CONTEXTS[7:], CANDIDATES[7:], llm=name, **{k: v[7:] for k, v in BATCH.items()})
    assert [len(s["indices"]) for s in stats] == [1, 0] and [s["optimizer_steps"] for s in stats] == [1, 1]
    expected = reference_training(tiny, before, [list(range(7)), [7]])
    assert_params(misc_run.state_dict(llm=name), expected, before)


def test_a_short_last_accumulation_group_is_stepped_and_nothing_leaks(misc_run, tiny):
    """5 samples, micro-batch 2, accumulation 2: micro-steps [2, 2] then [1] are two optimizer steps; the next
    update starts clean."""
    batch5 = {k: v[:5] for k, v in BATCH.items()}
    before = misc_run.state_dict(llm="short")
    (stats,) = misc_run.update(CONTEXTS[:5], CANDIDATES[:5], llm="short", **batch5)
    assert stats["micro_steps"] == 3 and stats["optimizer_steps"] == 2
    misc_run.update(CONTEXTS[5:], CANDIDATES[5:], llm="short", **{k: v[5:] for k, v in BATCH.items()})
    expected = reference_training(tiny, before, [[0, 1, 2, 3], [4], [5, 6, 7]])
    assert_params(misc_run.state_dict(llm="short"), expected, before)


# Candidates of the token-level test: token ids (a generated continuation) or text with boundary merges.
TOKEN_CONTEXTS = CONTEXTS[:4] + ["You see a wa", "Possible actions: tu", "x x x", "open the door"]
TOKEN_CANDIDATES = [[[17, 230, 41], [5]], [[64, 64, 12, 9], [200]], [[33], [34, 35]], [[120, 121], [122, 123, 124]],
                    ["ll 2 steps", "lk"], ["rn right", "rn left"], [" c1", [7, 8, 9]], [" now", " slowly"]]
TOKEN_ACTIONS = [0, 0, 1, 1, 0, 1, 1, 0]


def scored(tok, context: str, candidate) -> tuple[list[int], int]:
    """Plain HF's sequence and where the candidate's scored tokens start in it (text: the tokens of
    tokenize(context + candidate) after its common prefix with tokenize(context); ids: after the whole context)."""
    ctx = tok(context)["input_ids"]
    if not isinstance(candidate, str):
        return ctx + candidate, len(ctx)
    full = tok(context + candidate)["input_ids"]
    return full, next((k for k, (a, b) in enumerate(zip(ctx, full)) if a != b), min(len(ctx), len(full)))


@pytest.mark.parametrize("name", ["uneven-z2", "uneven-z3"])
def test_a_token_level_loss_equals_plain_sgd_steps(misc_run, tiny, name):
    """8 samples (4 per replica), then 1 (a replica with none, whose empty per-token outputs stay in the graph): each
    update is one SGD step on the mean token-level loss of its samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    sequences = [scored(tok, TOKEN_CONTEXTS[i], TOKEN_CANDIDATES[i][a]) for i, a in enumerate(TOKEN_ACTIONS)]
    assert sum(p < len(tok(c)["input_ids"]) for (_, p), c in zip(sequences, TOKEN_CONTEXTS)) >= 2, "boundary merges"
    token_weights = [[0.5 * (i + 1) * (-1) ** t for t in range(len(full) - p)] for i, (full, p) in enumerate(sequences)]
    before = misc_run.state_dict(llm=name)
    for group in (slice(0, 8), slice(5, 6)):
        stats = misc_run.update(TOKEN_CONTEXTS[group], TOKEN_CANDIDATES[group], llm=name,
                                actions=TOKEN_ACTIONS[group], token_weights=token_weights[group], entropy_coef=0.1)
        assert [s["optimizer_steps"] for s in stats] == [1, 1]
    assert [len(s["indices"]) for s in stats] == [1, 0]
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    model.load_state_dict({k[len("model."):]: v for k, v in before.items() if k.startswith("model.")})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for group in (slice(0, 8), slice(5, 6)):
        losses = []
        for (full, p), w in zip(sequences[group], token_weights[group]):
            logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0, p - 1:-1], -1)
            chosen = logp[torch.arange(len(full) - p), full[p:]]
            losses.append(-(torch.tensor(w) * chosen).sum() + 0.1 * (logp.exp() * logp).sum())
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()
    expected = {f"model.{k}": p.detach() for k, p in model.named_parameters()}
    assert_params(misc_run.state_dict(llm=name), expected, before)


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
