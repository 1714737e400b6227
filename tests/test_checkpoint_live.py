"""Checkpoints: save mid-run with the built-in (stateful) PPO updater, resume into a new run, and the next three
updates equal an uninterrupted run's exactly (Adam state, the updater's minibatch shuffling generator, heads,
LoRA, the cosine learning-rate schedule, whose rates every update reports and are checked by hand); the export
loads with plain transformers / peft and scores the same; heads are exported too."""

from __future__ import annotations

import math
import os

import pytest
import torch

from llmrl.engine.checkpoint_layout import MANIFEST
from testkit import LiveRun

pytestmark = pytest.mark.slow
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "open the door", "x x"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" slowly", " fast"], [" a", " b"]]


def ppo_batch(k: int) -> dict:
    """PPO's per-sample arguments for update number k (different every time)."""
    g = torch.Generator().manual_seed(k)
    return {"actions": [int(torch.randint(len(c), (1,), generator=g)) for c in CANDIDATES],
            "old_logprobs": (-torch.rand(4, generator=g) - 0.5).tolist(),
            "advantages": torch.randn(4, generator=g).tolist(), "returns": torch.randn(4, generator=g).tolist(),
            "old_values": torch.randn(4, generator=g).tolist()}


SCHEDULE = {"type": "cosine", "warmup_steps": 1, "total_steps": 7, "min_lr_ratio": 0.1}  # 2 optimizer steps an update


def scheduled_lr(step: int) -> float:
    """SCHEDULE's rate of optimizer step ``step`` (0-based), by hand."""
    if step < 1:
        return 0.0
    progress = min(1.0, (step - 1) / 6)
    return 0.01 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


FIRST = ppo_batch(0)
AFTER = [ppo_batch(k) for k in (1, 2, 3)]


def config(tiny, checkpoint=None, runs=None):
    training = {"optimizer": {"type": "adam", "lr": 0.01}, "micro_batch_size": 1, "gradient_accumulation_steps": 2,
                "lr_schedule": SCHEDULE}
    updater = {"plugin": "ppo", "args": {"epochs": 2, "seed": 7}}  # shuffles its minibatches: state to resume
    heads = {"value": {"plugin": "value", "args": {"hidden": 8}}}
    llms = {
        "adapter": {"model": tiny["llama"], "replicas": 2, "heads": heads, "updater": updater,
                    "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}],
                    "training": {**training, "zero_stage": 2}},
        "full": {"model": tiny["llama"], "replicas": 2, "heads": heads, "updater": updater,
                 "training": {**training, "zero_stage": 3}},
    }
    if checkpoint:
        for llm in llms.values():
            llm["checkpoint"] = checkpoint
    tracking = {"tracking": {"backends": ["csv"], "dir": str(runs), "run_name": "run"}} if runs else {}
    return {"llms": llms, "threads_per_rank": 1, **tracking}


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """An uninterrupted run: update, save, update again; what it held at the save and at the end."""
    path = str(tmp_path_factory.mktemp("ckpt") / "checkpoint")
    out = {"path": path}
    with LiveRun(config(tiny)) as run:
        for name in ("adapter", "full"):
            stats = run.update(CONTEXTS, CANDIDATES, llm=name, **FIRST)
            assert [s["optimizer_steps"] for s in stats] == [2, 2]  # 2 epochs of 2 samples, 2 micro-steps a step
            assert all(s["lr"] == pytest.approx(scheduled_lr(1), abs=1e-12) for s in stats)
        run.save(path)
        run.save(path)  # saving again over a checkpoint replaces it
        for name in ("adapter", "full"):
            out[name, "scores"] = run.score(CONTEXTS, CANDIDATES, llm=name)
            out[name, "values"] = run.custom_module_fns(["value"], CONTEXTS, llm=name)
            for k, batch in enumerate(AFTER):
                out[name, "stats"] = run.update(CONTEXTS, CANDIDATES, llm=name, **batch)
                lr = scheduled_lr(2 * k + 3)  # the last step of update k + 2 (updates take 2 steps)
                assert all(s["lr"] == pytest.approx(lr, abs=1e-12) for s in out[name, "stats"]), (k, lr)
            out[name, "final"] = run.state_dict(llm=name)
    return out


def test_the_checkpoint_is_complete_and_alone(saved):
    path = saved["path"]
    assert os.path.isfile(os.path.join(path, MANIFEST))
    assert sorted(os.listdir(os.path.dirname(path))) == ["checkpoint"]  # no staging or backup left behind
    for name in ("adapter", "full"):
        assert os.path.isdir(os.path.join(path, name, "deepspeed"))
        assert os.path.isfile(os.path.join(path, name, "export", "heads.safetensors"))


def test_resume_continues_exactly(saved, tiny, tmp_path):
    with LiveRun(config(tiny, checkpoint=saved["path"], runs=tmp_path)) as run:
        for name in ("adapter", "full"):
            for got, want in zip(run.score(CONTEXTS, CANDIDATES, llm=name), saved[name, "scores"]):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            for batch in AFTER:  # Adam's state and PPO's shuffling generator must both be restored
                stats = run.update(CONTEXTS, CANDIDATES, llm=name, **batch)
            assert stats == saved[name, "stats"]
            resumed, uninterrupted = run.state_dict(llm=name), saved[name, "final"]
            assert resumed.keys() == uninterrupted.keys()
            for key in resumed:
                assert torch.equal(resumed[key], uninterrupted[key]), f"{name} {key}"
    # the tracking's steps go on after the saved run's two updates (one per LLM), not from 1 again
    with open(tmp_path / "run" / "scalars.csv") as f:
        steps = sorted({int(row.split(",")[0]) for row in list(f)[1:] if ",update/" in row})
    assert steps == list(range(3, 3 + 2 * len(AFTER))), steps


@pytest.mark.parametrize("removed", ["rank-1.pt", "the state folder"])
def test_a_checkpoint_missing_a_ranks_state_is_refused_naming_it(saved, tiny, tmp_path, removed):
    """A checkpoint copied in part (or saved with fewer replicas) lacks a rank's generators and updater state: that
    rank would start them afresh and its replica train apart from the saved run; refused at set-up instead. A copy
    without the whole ``state`` folder started every rank afresh without a word."""
    import shutil

    copy = tmp_path / "partial"
    shutil.copytree(saved["path"], copy)
    if removed == "rank-1.pt":
        os.remove(copy / "adapter" / "state" / "rank-1.pt")
    else:
        shutil.rmtree(copy / "adapter" / "state")
    cfg = config(tiny, checkpoint=str(copy))
    del cfg["llms"]["full"]
    rank = 1 if removed == "rank-1.pt" else 0
    with pytest.raises(Exception, match=rf"holds no state for rank {rank} of LLM 'adapter' \(rank-{rank}.pt; it holds"):
        with LiveRun(cfg) as run:
            run.score(CONTEXTS, CANDIDATES, llm="adapter")


def test_a_resume_whose_lora_alpha_changed_is_refused(saved, tiny):
    """DeepSpeed loads the adapter's weights whatever the config's alpha: under another alpha / r they would act
    scaled differently (scores moved by 0.65 on the tiny model). Refused at set-up, naming both scalings."""
    cfg = config(tiny, checkpoint=saved["path"])
    del cfg["llms"]["full"]
    cfg["llms"]["adapter"]["initializers"][0]["args"]["adapters"]["default"]["alpha"] = 16
    with pytest.raises(Exception, match=r"adapter 'default' was trained with LoRA scaling \(alpha / r\) 2.0 .* "
                                        r"the config gives 4.0"):
        with LiveRun(cfg) as run:
            run.score(CONTEXTS, CANDIDATES, llm="adapter")


def test_a_resume_under_another_optimizer_or_zero_stage_is_refused_naming_both(saved, tiny):
    """Each failed deep inside DeepSpeed: KeyError 'momentum', a missing optim_states file, a bare AssertionError."""
    cfg = config(tiny, checkpoint=saved["path"])
    del cfg["llms"]["full"]
    cfg["llms"]["adapter"]["training"]["zero_stage"] = 0
    cfg["llms"]["adapter"]["training"]["optimizer"]["type"] = "adamw"
    with pytest.raises(Exception, match=r"saved with ZeRO stage 2 \(the config gives 0\) and optimizer 'adam' "
                                        r"\(the config gives 'adamw'\)"):
        with LiveRun(cfg) as run:
            run.score(CONTEXTS, CANDIDATES, llm="adapter")


def test_a_resume_with_another_learning_rate_trains_at_the_configs(saved, tiny):
    """DeepSpeed brought back the saved optimizer's lr (and betas, eps, weight decay): a resume at a tenth of the rate
    trained at the old one without a word. The schedule now runs from the config's lr at the saved step. (Saved under
    ZeRO 2, resumed under ZeRO 1.)"""
    cfg = config(tiny, checkpoint=saved["path"])
    del cfg["llms"]["full"]
    cfg["llms"]["adapter"]["training"]["optimizer"]["lr"] = 0.001
    cfg["llms"]["adapter"]["training"]["zero_stage"] = 1  # ZeRO 1 and 2 write the same optimizer state: taken
    with LiveRun(cfg) as run:
        stats = run.update(CONTEXTS, CANDIDATES, llm="adapter", **AFTER[0])
    assert all(s["lr"] == pytest.approx(scheduled_lr(3) / 10, abs=1e-12) for s in stats), stats


def _plain_scores(model, tok):
    from testkit import reference_scores

    return reference_scores(model, tok, CONTEXTS, CANDIDATES)


def test_exports_load_with_plain_transformers_and_peft(saved, tiny):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.plugins.contracts import LLMInfo
    from llmrl.plugins.value_head import ValueHead

    export = os.path.join(saved["path"], "adapter", "export")
    tok = AutoTokenizer.from_pretrained(os.path.join(export, "tokenizer"))
    base = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    peft_model = PeftModel.from_pretrained(base, os.path.join(export, "adapters", "default")).eval()
    for got, want in zip(_plain_scores(peft_model, tok), saved["adapter", "scores"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    export = os.path.join(saved["path"], "full", "export")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(export, "model")).eval()
    for got, want in zip(_plain_scores(model, tok), saved["full", "scores"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    head = ValueHead(LLMInfo("x", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                             torch.device("cpu")), hidden=8)
    heads = load_file(os.path.join(export, "heads.safetensors"))
    head.load_state_dict({k[len("value."):]: v for k, v in heads.items()})
    with torch.no_grad():
        for context, want in zip(CONTEXTS, saved["full", "values"]):
            hidden = model(**tok(context, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][:, -1]
            value = head.mlp(hidden).squeeze()
            assert float(value) == pytest.approx(float(want["value"]), abs=1e-4)
