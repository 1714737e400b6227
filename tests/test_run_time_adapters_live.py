"""Adapters created at run time where DeepSpeed owns the optimizer step (ZeRO 1-3, bfloat16, float16), which step with
an optimizer of their own (:mod:`llmrl.engine.model.training.own_optimizers`): two adapters created, then three times
``forward_backward`` of each (both pending at once) and ``optim_step(peft_adapter=...)`` of each: each equals a plain
PEFT model stepped by torch AdamW over float32 master copies of the adapter's weights (the forward in the model's
dtype), for 1 and 2 replicas, and for 2 tensor-parallel ranks (float32 at ZeRO 0, where a run-time adapter is a group of
the engine's own optimizer, bfloat16 at ZeRO-2, and bfloat16 at ZeRO-3 with 2 replicas of 2 ranks, where the base's
shards and the configured adapter are partitioned over the replicas; the adapters are whole on each rank, which applies
them in parts: :mod:`llmrl.engine.model.tp_lora`); the configured adapter and the base weights stay bit-identical;
``save_adapter`` / ``load_adapter`` carry the adapter and its moments (the copy then steps as the original), and so does
a checkpoint (a resumed run steps it as the saved one would have); a snapshot of it scores as it does. Under ZeRO-3 the
base and the configured adapter are partitioned over the replicas, and the adapter created at run time is whole on each.
In float16 (at ZeRO 0, and 3 with 2 replicas; DeepSpeed's CPU accelerator computes it here:
``testkit.cpu_float16``) the gradients carry the loss scale, which each step divides out
(:mod:`llmrl.engine.model.training.loss_scale`); a step whose gradients overflow it is skipped, on an LLM at ZeRO-2
whose scale starts at 2**20 (whose steps are checked against plain PEFT too).

Tolerances: float32 1e-5 (absolute, on weights of order 1e-1; measured 7e-8, and 2.5e-7 with tensor parallelism, whose
ranks sum the row-parallel layers' parts in another order; without the sum of the column-parallel A's output gradient
over the ranks it is 7e-3); bfloat16 and float16: the served and the reference forwards round differently, and Adam
moves a weight by about its learning rate whatever the size of its gradient, so a gradient near zero whose sign the
rounding flips moves its weight the other way: the weights' change over the three steps is compared as a whole (2-norm
of the difference over 2-norm of the change: 0.3; measured 0.02-0.15 in bfloat16, 0.013-0.041 in float16), and the
gradient norms to 5e-2 relative (measured 5e-3 in bfloat16, 1e-3 in float16), which a wrong average over the replicas
would miss by 2x and a wrong loss scale by a power of 2. PEFT makes a run-time adapter float32 in a bfloat16 or float16
model, so its weights are their own masters here; the separate masters of half-precision weights are checked in
``test_own_optimizers.py``.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun
from testkit.cpu_float16 import FLOAT16_ENV

pytestmark = pytest.mark.slow

LAYOUTS = {"f32z2r1": ("float32", 2, 1, 1), "bf16z0r1": ("bfloat16", 0, 1, 1),
           "bf16z2r2": ("bfloat16", 2, 2, 1), "f32z3r1": ("float32", 3, 1, 1),
           "bf16z3r2": ("bfloat16", 3, 2, 1), "f32z0tp2": ("float32", 0, 1, 2), "bf16z2tp2": ("bfloat16", 2, 1, 2),
           "bf16z3r2tp2": ("bfloat16", 3, 2, 2), "f16z0r1": ("float16", 0, 1, 1), "f16z3r2": ("float16", 3, 2, 1)}
# (dtype, ZeRO stage, replicas, tensor-parallel ranks)
CPU_FLOAT16 = {FLOAT16_ENV: "1"}  # DeepSpeed's CPU accelerator computes float16 here too (testkit.cpu_float16)
FLOAT16 = {"fp16": {"initial_scale_power": 8}}  # a loss scale of 256: no overflow (OVERFLOW's is 2**20)
OVERFLOW = "f16overflow"  # float16 at ZeRO-2, whose first steps overflow: float16_overflow()
ADAMW = {"type": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
NEW = {"rank": 2, "targets": ["attention", "mlp"]}
ADAPTERS = {"t": 3, "v": 20}  # created at run time: name -> seed (and the offset of its data's seeds)
RATES = [3e-3, 2e-3, 2.5e-3]
RESUMED = ["f32z2r1", "bf16z2r2", "bf16z3r2", "f32z0tp2", "bf16z3r2tp2"]
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.3, "float16": 0.3}  # float32: absolute; else relative to the change
# one generate call whose prompts name different adapters: created at run time, configured, snapshots of each
PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "x", "a red key", "the door is", "open it"]
MIXED = ["t", "default", "s", "v", "t", "d"]
GREEDY = {"max_new_tokens": 5, "do_sample": False}
TWINS = {"p": 31, "q": 32, "p2": 31, "q2": 32}  # p and q trained in one call, p2 and q2 (same seeds) alone


def make_data(seed: int, lengths=(7, 12, 4)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(3, 100, (n,), generator=g).tolist()
        mask = torch.tensor([0.0] * (n // 2 - 1) + [1.0] * (n - n // 2))
        data.append({"model_input": tokens[:-1], "loss_fn_inputs": {
            "target_tokens": tokens[1:], "weights": (mask * (torch.rand(n - 1, generator=g) + 0.5)).tolist()}})
    return data


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """Every layout through the sequence; the states along the way."""
    llms = {name: {"model": tiny["llama"], "dtype": dtype, "replicas": replicas, "initializers": [LORA],
                   "tensor_parallel": tp,
                   "trainable": True,  # forward_backward in passes of at most 16 tokens: several per call
                   "training": {"zero_stage": zero, "optimizer": ADAMW, "max_tokens_per_micro_batch": 16,
                                **({"deepspeed": FLOAT16} if dtype == "float16" else {})}}
            for name, (dtype, zero, replicas, tp) in LAYOUTS.items()}
    llms[OVERFLOW] = {**llms["f16z0r1"], "training": {  # ZeRO-2: the float16 layouts' stage not above
        **llms["f16z0r1"]["training"], "zero_stage": 2, "deepspeed": {"fp16": {"initial_scale_power": 20}}}}
    out = {}
    folder = tmp_path_factory.mktemp("run-time-adapters")
    with LiveRun({"llms": llms, "threads_per_rank": 1}, env=CPU_FLOAT16) as run:
        for name in LAYOUTS:
            out[name, "start"] = run.state_dict(llm=name)
            for adapter in ADAPTERS:
                run.create_adapter(adapter, llm=name, **NEW, seed=ADAPTERS[adapter])
                out[name, adapter, "norms"] = []
            out[name, "created"] = run.state_dict(llm=name)
            for k, rate in enumerate(RATES):  # both adapters' gradients pending at once, each stepped alone
                for adapter in ADAPTERS:
                    run.forward_backward(make_data(k + ADAPTERS[adapter]), "cross_entropy", llm=name,
                                         peft_adapter=adapter)
                for adapter in ADAPTERS:
                    stepped = run.optim_step({"learning_rate": rate}, llm=name, peft_adapter=adapter)
                    out[name, adapter, "norms"].append(stepped["grad_norm"])
            out[name, "end"] = run.state_dict(llm=name)
        run.save(folder / "checkpoint")
        for name in LAYOUTS:
            step_after_save(run, name)
            out[name, "stepped after the save"] = run.state_dict(llm=name)
            run.snapshot("s", llm=name, peft_adapter="t")
            run.snapshot("d", llm=name, peft_adapter="default")  # under ZeRO-3, of partitioned weights
            out[name, "scores"] = [run.forward(make_data(9), None, llm=name, peft_adapter=a)["loss_fn_outputs"]
                                   for a in ("t", "s", "default", "d")]
            out[name, "mixed"] = run.generate(PROMPTS, llm=name, peft_adapter=MIXED, **GREEDY)
            out[name, "alone"] = {a: run.generate(PROMPTS, llm=name, peft_adapter=a, **GREEDY) for a in set(MIXED)}
            out[name, "two in one call"] = train_two_in_one_call(run, name)
            copies = run.state_dict(llm=name)
            out[name, "d"] = {k: v for k, v in copies.items() if ".default." in k or ".d." in k}
            run.drop_snapshot("d", llm=name)
            run.save_adapter(folder / name, llm=name, peft_adapter="t")
            run.load_adapter(folder / name, "u", llm=name)
            for adapter in ("t", "u"):
                run.forward_backward(make_data(7), "cross_entropy", llm=name, peft_adapter=adapter)
                run.optim_step({"learning_rate": 2e-3}, llm=name, peft_adapter=adapter)
            out[name, "copied"] = run.state_dict(llm=name)
            run.drop_snapshot("s", llm=name)
            for adapter in ("t", "u", "v"):
                run.delete_adapter(adapter, llm=name)
            out[name, "deleted"] = run.state_dict(llm=name)
            if LAYOUTS[name][0] == "float16":  # the configured adapter, which DeepSpeed steps, once
                run.forward_backward(make_data(60), "cross_entropy", llm=name, peft_adapter="default")
                out[name, "default step"] = run.optim_step({"learning_rate": 1e-3}, llm=name, peft_adapter="default")
        out["overflow"] = float16_overflow(run)
    for name in RESUMED:  # the masters and moments of t come back with the checkpoint
        llms[name]["checkpoint"] = str(folder / "checkpoint")
    with LiveRun({"llms": {name: llms[name] for name in RESUMED}, "threads_per_rank": 1}, env=CPU_FLOAT16) as run:
        for name in RESUMED:
            step_after_save(run, name)
            out[name, "stepped after the resume"] = run.state_dict(llm=name)
    return out


def float16_overflow(run) -> dict:
    """On OVERFLOW (float16, a loss scale of 2**20, which the tiny model's gradients overflow): adapter t's
    forward_backward and optim_step until a step is taken (each overflow skips the step, drops the gradients and
    halves the scale: the forward_backward is sent again); then v's forward_backward, pending while adapter w's
    gradients (of datums weighted 1e5) overflow at w's optim_step, and v's optim_step. The states and answers."""
    for adapter, seed in {**ADAPTERS, "w": 5}.items():
        run.create_adapter(adapter, llm=OVERFLOW, **NEW, seed=seed)
    out = {"created": run.state_dict(llm=OVERFLOW), "t": []}
    while not out["t"] or out["t"][-1]["optimizer_steps"] == 0 and len(out["t"]) < 30:
        run.forward_backward(make_data(ADAPTERS["t"]), "cross_entropy", llm=OVERFLOW, peft_adapter="t")
        out["t"].append(run.optim_step({"learning_rate": RATES[0]}, llm=OVERFLOW, peft_adapter="t"))
    run.forward_backward(make_data(ADAPTERS["v"]), "cross_entropy", llm=OVERFLOW, peft_adapter="v")
    heavy = make_data(5)
    for datum in heavy:
        datum["loss_fn_inputs"]["weights"] = [1e5 * w for w in datum["loss_fn_inputs"]["weights"]]
    run.forward_backward(heavy, "cross_entropy", llm=OVERFLOW, peft_adapter="w")
    out["w"] = run.optim_step({"learning_rate": RATES[0]}, llm=OVERFLOW, peft_adapter="w")
    out["v"] = [run.optim_step({"learning_rate": RATES[0]}, llm=OVERFLOW, peft_adapter="v")]
    out["end"] = run.state_dict(llm=OVERFLOW)
    return out


def train_two_in_one_call(run, name: str) -> dict:
    """Adapters p and q trained together (each round one forward_backward whose datums name p or q, then a step of
    each), and their twins p2 and q2 (created with the same seeds) trained alone on the same data."""
    for adapter, seed in TWINS.items():
        run.create_adapter(adapter, llm=name, **NEW, seed=seed)
    out = {"created": run.state_dict(llm=name), "calls": [], "norms": {a: [] for a in TWINS}}
    for k in range(2):
        ours, theirs = make_data(40 + k), make_data(50 + k, lengths=(5, 9))
        data = [ours[0], theirs[0], ours[1], theirs[1], ours[2]]
        mixed = run.forward_backward(data, "cross_entropy", llm=name, peft_adapter=["p", "q", "p", "q", "p"])
        alone = [run.forward_backward(d, "cross_entropy", llm=name, peft_adapter=a) for d, a in ((ours, "p2"),
                                                                                                  (theirs, "q2"))]
        out["calls"].append((mixed, alone))
        for adapter, rate in zip(TWINS, (3e-3, 2e-3, 3e-3, 2e-3)):
            out["norms"][adapter].append(run.optim_step({"learning_rate": rate}, llm=name,
                                                        peft_adapter=adapter)["grad_norm"])
    out["end"] = run.state_dict(llm=name)
    for adapter in TWINS:
        run.delete_adapter(adapter, llm=name)
    return out


def step_after_save(run, name: str) -> None:
    run.forward_backward(make_data(5), "cross_entropy", llm=name, peft_adapter="t")
    run.optim_step({"learning_rate": 2e-3}, llm=name, peft_adapter="t")


def reference(tiny, dtype: str, created: dict, adapter: str, rates=RATES):
    """A plain PEFT model holding ``created`` (adapters default and ``adapter``), AdamW over float32 masters of the
    adapter's weights, stepped as the run stepped it; its weights at the end and the gradient norms."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=getattr(torch, dtype)).eval()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    peft.add_adapter(adapter, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear"))
    named = dict(peft.named_parameters())
    with torch.no_grad():
        for key, p in named.items():
            p.copy_(created[f"model.{key}"])
    peft.set_adapter(adapter)
    params = {k: p for k, p in named.items() if ".lora_" in k and f".{adapter}." in k}
    masters = {k: p.detach().float().clone().requires_grad_(True) for k, p in params.items()}
    optimizer = torch.optim.AdamW(list(masters.values()), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    norms = []
    for k, rate in enumerate(rates):
        for p in params.values():
            p.requires_grad_(True)
            p.grad = None
        loss = sum((-torch.tensor(d["loss_fn_inputs"]["weights"]) * logprobs(peft, d)).sum()
                   for d in make_data(k + ADAPTERS[adapter]))
        loss.backward()
        for key, m in masters.items():
            m.grad = params[key].grad.float()
        norms.append(float(torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters.values()]))))
        optimizer.param_groups[0]["lr"] = rate
        optimizer.step()
        with torch.no_grad():
            for key, m in masters.items():
                params[key].copy_(m)
    return {f"model.{k}": p.detach().clone() for k, p in params.items()}, norms


def logprobs(model, datum: dict) -> torch.Tensor:
    logp = torch.log_softmax(model(input_ids=torch.tensor([datum["model_input"]])).logits[0].float(), -1)
    return logp.gather(1, torch.tensor(datum["loss_fn_inputs"]["target_tokens"])[:, None])[:, 0]


def same(a: dict, b: dict, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.budget(150, why="its first case starts the module's shared run (ten layouts of one LLM and a "
                              "float16 one that overflows, trained, snapshotted, saved and resumed, for every test "
                              "here): 90-115 s in the suite on a 2-core AVX2-only EPYC")
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_a_run_time_adapter_steps_as_plain_peft_with_adamw_over_float32_masters(runs, tiny, name, adapter):
    dtype = LAYOUTS[name][0]
    start, created, end = runs[name, "start"], runs[name, "created"], runs[name, "end"]
    untouched = list(start)  # the base and the configured adapter
    assert same(start, created, untouched) and same(start, end, untouched), "only t and v may move"
    expected, norms = reference(tiny, dtype, created, adapter)
    assert expected.keys() == {k for k in end if f".{adapter}." in k and ".lora_" in k}
    moved = max(float((want.float() - created[k].float()).abs().max()) for k, want in expected.items())
    assert moved > 1e-3
    worst = max(float((end[k].float() - want.float()).abs().max()) for k, want in expected.items())
    change = torch.cat([(want.float() - created[k].float()).reshape(-1) for k, want in expected.items()])
    off = torch.cat([(end[k].float() - want.float()).reshape(-1) for k, want in expected.items()])
    relative = float(off.norm() / change.norm())
    print(f"{name} {adapter}: largest change {moved:.3g}; difference to the reference: largest {worst:.3g}, "
          f"relative to the change (2-norm) {relative:.3g}; grad norms {runs[name, adapter, 'norms']} vs {norms}")
    if dtype == "float32":
        assert worst <= TOLERANCE[dtype], worst
    else:  # Adam moves a weight by about lr whatever its gradient's size: rounding flips near-zero gradients' signs
        assert relative <= TOLERANCE[dtype], relative
    torch.testing.assert_close(torch.tensor(runs[name, adapter, "norms"]), torch.tensor(norms),
                               rtol=1e-4 if dtype == "float32" else 5e-2, atol=0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_run_time_adapter_saved_loaded_and_snapshotted_acts_as_itself(runs, name):
    scores_t, scores_s, scores_default, scores_d = runs[name, "scores"]
    for t, s in [*zip(scores_t, scores_s), *zip(scores_default, scores_d)]:  # (float32 matmuls of trained and
        torch.testing.assert_close(t["logprobs"], s["logprobs"], atol=1e-5, rtol=0)  # frozen layers may round apart)
    assert not torch.allclose(scores_t[0]["logprobs"], scores_d[0]["logprobs"], atol=1e-4)  # two other adapters
    both = runs[name, "d"]  # d holds weights of its own, equal to the configured adapter's (gathered under ZeRO-3)
    copied = {k.replace(".d.", ".default."): v for k, v in both.items() if ".d." in k}
    assert copied and copied.keys() == {k for k in both if ".default." in k}
    for key, value in copied.items():
        torch.testing.assert_close(value, both[key], atol=0, rtol=0)
    copied, start = runs[name, "copied"], runs[name, "start"]
    t = {k.replace(".t.", "."): v for k, v in copied.items() if ".t." in k and ".lora_" in k}
    u = {k.replace(".u.", "."): v for k, v in copied.items() if ".u." in k and ".lora_" in k}
    assert t.keys() == u.keys() and t
    assert not same(copied, runs[name, "end"], [k for k in copied if ".t." in k and ".lora_" in k])
    tolerance = 1e-6 if LAYOUTS[name][0] == "float32" else 1e-2  # bfloat16: u's masters start from t's weights
    for key in t:
        torch.testing.assert_close(u[key].float(), t[key].float(), atol=tolerance, rtol=0)
    assert runs[name, "deleted"].keys() == start.keys() and same(start, runs[name, "deleted"], list(start))


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_time_adapter_resumed_from_a_checkpoint_steps_on_as_before_the_save(runs, name):
    before, after = runs[name, "stepped after the save"], runs[name, "stepped after the resume"]
    assert before.keys() == after.keys()
    assert not same(before, runs[name, "end"], [k for k in before if ".t." in k and ".lora_" in k])
    for key in before:
        torch.testing.assert_close(after[key], before[key], atol=1e-6, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prompts_naming_different_adapters_decode_in_one_call_as_each_alone(runs, name):
    """Multi-LoRA batching: each prompt of the mixed call says which policy it read, and in float32 decodes as in a
    call of its adapter alone: the same tokens, log-probs to 1e-5. (In bfloat16 the mixed pass rounds each adapter's
    output to bfloat16 before adding it, and the tiny random model's near-ties then pick other tokens: there the rows'
    adapters are checked in float32 and in test_row_adapters.py.)"""
    mixed, alone = runs[name, "mixed"], runs[name, "alone"]
    for index, adapter in enumerate(MIXED):
        (mine,), (theirs,) = mixed[index], alone[adapter][index]
        assert mine["policy"] == theirs["policy"] == adapter
        assert mine["policy_version"] == theirs["policy_version"]
        assert bool(torch.isfinite(mine["logprobs"]).all())
        if LAYOUTS[name][0] == "float32":
            assert mine["tokens"].tolist() == theirs["tokens"].tolist(), (adapter, mine, theirs)
            torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], atol=1e-5, rtol=0)
    assert len({str(alone[a][0][0]["logprobs"].tolist()) for a in ("t", "v", "default")}) == 3  # adapters differ


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_datums_naming_two_adapters_train_in_one_call_as_each_alone(runs, name):
    """Multi-LoRA batching of training calls: one forward_backward whose datums name p or q gives each datum the
    log-probs and loss of a call of its adapter alone, and each adapter the gradients of its own datums: after two
    rounds of steps, p and q hold the weights of their twins p2 and q2 trained alone (created with the same seeds),
    with the same gradient norms. float32: log-probs to 1e-5, norms to 1e-4 relative (measured 2e-7), weights to
    1e-4 absolute and 1e-3 of their change (2-norm; measured 2.8e-5 and 1.8e-4: the two passes sum in another order,
    and Adam's step divides a near-zero gradient's rounding by its own size); bfloat16 (the passes lay rows out
    differently, and bfloat16 rounds each layout apart): log-probs to 0.05, weights to 0.3 of their change (2-norm,
    as above; measured 0.02-0.17) and norms to 5e-2 (measured 2.5e-3). A gradient of the other adapter's datums, or
    none, moves the weights by the whole change."""
    got = runs[name, "two in one call"]
    created, end, norms = got["created"], got["end"], got["norms"]
    half = LAYOUTS[name][0] != "float32"
    for one, twin in (("p", "p2"), ("q", "q2")):
        keys = {k: k.replace(f".{one}.", f".{twin}.") for k in created if f".{one}." in k and ".lora_" in k}
        assert keys and all(torch.equal(created[k], created[t]) for k, t in keys.items())  # the same start
        change = torch.cat([(end[t].float() - created[t].float()).reshape(-1) for t in keys.values()])
        off = torch.cat([(end[k].float() - end[t].float()).reshape(-1) for k, t in keys.items()])
        assert float(change.abs().max()) > 1e-3
        print(f"{name} {one}: largest change {float(change.abs().max()):.3g}; difference to {twin}: largest "
              f"{float(off.abs().max()):.3g}, relative to the change (2-norm) {float(off.norm() / change.norm()):.3g}; "
              f"grad norms {norms[one]} vs {norms[twin]}")
        if half:
            assert float(off.norm() / change.norm()) <= 0.3
        else:
            assert float(off.abs().max()) <= 1e-4 and float(off.norm() / change.norm()) <= 1e-3
        torch.testing.assert_close(torch.tensor(norms[one]), torch.tensor(norms[twin]), atol=0,
                                   rtol=5e-2 if half else 1e-4)
    for mixed, (ours, theirs) in got["calls"]:
        outputs = mixed["loss_fn_outputs"]
        for mine, alone in zip([outputs[0], outputs[2], outputs[4], outputs[1], outputs[3]],
                               ours["loss_fn_outputs"] + theirs["loss_fn_outputs"]):
            for key in ("logprobs", "elementwise_loss"):
                torch.testing.assert_close(mine[key], alone[key], atol=5e-2 if half else 1e-5, rtol=0)
        total = ours["metrics"]["loss:sum"] + theirs["metrics"]["loss:sum"]
        assert mixed["metrics"]["loss:sum"] == pytest.approx(total, rel=1e-2 if half else 1e-5)


def test_a_float16_overflow_skips_the_adapters_step_and_halves_the_loss_scale(runs, tiny):
    """Each optim_step whose gradients overflow at the loss scale is skipped (its answer says so, with the halved
    scale) and changes nothing; the step taken at last, and the step of an adapter whose gradients were pending
    while another's overflow halved the scale, equal one step of plain PEFT + AdamW (float16 tolerance as above;
    gradient norms to 5e-2: a gradient left at the scale it was computed at would be off by 2x)."""
    got = runs["overflow"]
    t, w, v = got["t"], got["w"], got["v"]
    assert len(t) >= 2 and t[-1]["optimizer_steps"] == 1 and t[-1]["adapters"] == ["t"], t
    scales = [answer["loss_scale"] for answer in t[:-1]]
    assert all(answer == {"optimizer_steps": 0, "adapters": [], "grad_norm": None, "skipped": ["t"],
                          "loss_scale": scale, "policy_version": 0} for answer, scale in zip(t[:-1], scales)), t
    assert scales == [2.0 ** (19 - k) for k in range(len(scales))] and "skipped" not in t[-1]
    assert w == {"optimizer_steps": 0, "adapters": [], "grad_norm": None, "skipped": ["w"],
                 "loss_scale": scales[-1] / 2, "policy_version": 0}
    assert v[-1]["optimizer_steps"] == 1 and v[-1]["adapters"] == ["v"], v
    assert all(torch.equal(got["end"][k], got["created"][k]) for k in got["created"] if ".w." in k)
    for adapter, answers in (("t", t), ("v", v)):
        expected, norms = reference(tiny, "float16", got["created"], adapter, rates=RATES[:1])
        keys = sorted(expected)
        change = torch.cat([(expected[k] - got["created"][k]).float().flatten() for k in keys])
        off = torch.cat([(got["end"][k] - expected[k]).float().flatten() for k in keys])
        print(f"overflow {adapter}: relative to the change (2-norm) {float(off.norm() / change.norm()):.3g}; "
              f"grad norm {answers[-1]['grad_norm']} vs {norms}")
        assert float(off.norm() / change.norm()) <= TOLERANCE["float16"], float(off.norm() / change.norm())
        torch.testing.assert_close(torch.tensor([answers[-1]["grad_norm"]]), torch.tensor(norms), rtol=5e-2, atol=0)


@pytest.mark.parametrize("name", [name for name in LAYOUTS if LAYOUTS[name][0] == "float16"])
def test_the_configured_adapters_float16_gradient_norm_is_plain_peft_s(runs, tiny, name):
    """DeepSpeed steps the configured adapter: the gradient norm it reports (unscaled) equals plain PEFT's in
    float16, to 5e-2. At ZeRO 0 DeepSpeed's float16 optimizer divides by the loss scale a loss it did not scale: it
    would be off by the scale (256) without llmrl's scaling of the loss before ``engine.backward``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float16).eval()
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    state = runs[name, "deleted"]
    with torch.no_grad():
        for key, p in peft.named_parameters():
            p.copy_(state[f"model.{key}"])
    sum((-torch.tensor(d["loss_fn_inputs"]["weights"]) * logprobs(peft, d)).sum() for d in make_data(60)).backward()
    grads = [p.grad.float().norm() for p in peft.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(grads))
    answer = runs[name, "default step"]
    assert answer["optimizer_steps"] == 1 and answer["adapters"] == ["default"], answer
    torch.testing.assert_close(torch.tensor(answer["grad_norm"]), norm, rtol=5e-2, atol=0)
