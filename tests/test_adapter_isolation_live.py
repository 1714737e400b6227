"""Two LoRA adapters trained in turn each equal a plain PEFT model trained alone with its own optimizer, and an
update of one leaves the other's weights bit-identical: Adam, AdamW and SGD with momentum (the optimizers whose
state moves a weight whose gradient is zero), ZeRO 0-3, 1 and 2 replicas, across a save and a resume.

The sequence is b, b, a, a, save; resume, b. If an update of ``a`` stepped ``b``'s weights, moments or step
counts (as a zero gradient through one shared optimizer does), ``b`` would move during the a-updates and its last
update would differ from the reference, which steps ``b`` with an optimizer that never saw ``a``. The resumed run
clips gradients where the saved one did not: the config's clipping must apply after a resume at every ZeRO stage
(DeepSpeed's ZeRO-1/2 optimizers restore the saved value).
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun

pytestmark = pytest.mark.slow

CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café and", "東京 is",
            "x x x", "In the kitchen you see a fridge.", "pick up the key", "open the door"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"], [" naïve", " über"], [" big"],
              [" c1", " c2", " c3"], [" open fridge", " go north"], [" now", " later"], [" slowly", " fast", "!"]]
BATCH = {"actions": [1, 0, 1, 0, 2, 1, 0, 2], "weights": [1.0, -0.5, 2.0, 0.3, -1.0, 0.7, 1.5, -0.2]}
OPTIMIZERS = {
    "adam": {"type": "adam", "lr": 1e-2, "betas": [0.8, 0.95], "eps": 1e-4},
    "adamw": {"type": "adamw", "lr": 1e-2, "betas": [0.85, 0.9], "eps": 1e-4, "weight_decay": 0.1},
    "sgdm": {"type": "sgd", "lr": 0.5, "momentum": 0.9},
}
# Each ZeRO stage once, each optimizer, both replica counts; and 2 tensor-parallel ranks (the adapters whole on each,
# applied in parts over the split layers: llmrl.engine.model.tp_lora). name -> (optimizer, ZeRO stage, replicas, TP)
LAYOUTS = {"adam-z0r1": ("adam", 0, 1, 1), "adamw-z1r2": ("adamw", 1, 2, 1), "sgdm-z2r2": ("sgdm", 2, 2, 1),
           "adam-z3r2": ("adam", 3, 2, 1), "adamw-z2tp2": ("adamw", 2, 1, 2)}
BEFORE_SAVE = ["b", "b", "a", "a"]
AFTER_RESUME = ["b"]
CLIP_AFTER_RESUME = 0.05  # training.gradient_clipping of the resumed run (saved without): ZeRO-1/2 kept the saved 0


def config(tiny, checkpoint=None) -> dict:
    lora = {"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}
    llms = {}
    for name, (optimizer, zero, replicas, tp) in LAYOUTS.items():
        llms[name] = {"model": tiny["llama"], "replicas": replicas, "tensor_parallel": tp, "initializers": [lora],
                      "updater": "llmrl_test_plugins:ChosenScoreUpdater",
                      "training": {"zero_stage": zero, "optimizer": OPTIMIZERS[optimizer],
                                   "micro_batch_size": 8, "gradient_accumulation_steps": 1}}
        if checkpoint:
            llms[name]["checkpoint"] = checkpoint
            llms[name]["training"]["gradient_clipping"] = CLIP_AFTER_RESUME
    return {"llms": llms, "threads_per_rank": 1}


def adapter_weights(state: dict, adapter: str) -> dict:
    return {k: v for k, v in state.items() if ".lora_" in k and f".{adapter}." in k}


def update_and_check_the_other_stays(run, name: str, adapter: str) -> None:
    other = "b" if adapter == "a" else "a"
    before = run.state_dict(llm=name)
    run.update(CONTEXTS, CANDIDATES, llm=name, adapter=adapter, **BATCH)
    after = run.state_dict(llm=name)
    for key, value in adapter_weights(before, other).items():
        assert torch.equal(after[key], value), f"{name}: updating {adapter} moved {key}"
    assert any(not torch.equal(after[k], v) for k, v in adapter_weights(before, adapter).items())
    base = [k for k in before if ".lora_" not in k]
    assert all(torch.equal(before[k], after[k]) for k in base), "the base model is frozen"


def plain_peft(tiny, state: dict):
    """A plain PEFT model with adapters a and b (as the lora initializer makes them) holding ``state``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    spec = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
    peft = get_peft_model(model, LoraConfig(**spec), adapter_name="a")
    peft.add_adapter("b", LoraConfig(**spec))
    with torch.no_grad():
        for key, p in peft.named_parameters():
            p.copy_(state[f"model.{key}"])
    return peft.eval()


def chosen_score(peft, tok, context: str, candidate: str) -> torch.Tensor:
    ctx_ids, full = tok(context)["input_ids"], tok(context + candidate)["input_ids"]
    p = next((k for k, (x, y) in enumerate(zip(ctx_ids, full)) if x != y), min(len(ctx_ids), len(full)))
    logp = torch.log_softmax(peft(input_ids=torch.tensor([full])).logits[0], -1)
    return sum(logp[t - 1, full[t]] for t in range(p, len(full)))


def reference(tiny, start: dict, sequence: list[str], spec: dict) -> tuple[dict, list[float]]:
    """Each adapter trained alone with its own torch optimizer, in the given order, its gradient clipped to
    CLIP_AFTER_RESUME after the save; the LoRA weights at the end and the norms of the clipped gradients."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    peft = plain_peft(tiny, start)
    named = {f"model.{k}": p for k, p in peft.named_parameters()}
    optimizers = {}
    for adapter in ("a", "b"):
        params = [p for k, p in named.items() if ".lora_" in k and f".{adapter}." in k]
        kind = spec["type"]
        if kind == "sgd":
            optimizers[adapter] = torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"])
        else:
            cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
            optimizers[adapter] = cls(params, lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                                      weight_decay=spec.get("weight_decay", 0.0))
    norms = []
    for k, adapter in enumerate(sequence):
        peft.set_adapter(adapter)
        for key, p in named.items():
            p.requires_grad_(".lora_" in key and f".{adapter}." in key)
        optimizers[adapter].zero_grad()
        losses = [-BATCH["weights"][i] * chosen_score(peft, tok, CONTEXTS[i], CANDIDATES[i][BATCH["actions"][i]])
                  for i in range(len(CONTEXTS))]
        torch.stack(losses).mean().backward()
        if k >= len(BEFORE_SAVE):
            params = [p for group in optimizers[adapter].param_groups for p in group["params"]]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP_AFTER_RESUME)))
        optimizers[adapter].step()
    return {k: p.detach().clone() for k, p in named.items() if ".lora_" in k}, norms


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """The sequence run on every layout, with a save and a resume in a new run; the states along the way."""
    path = str(tmp_path_factory.mktemp("adapters") / "checkpoint")
    out = {}
    with LiveRun(config(tiny)) as run:
        for name in LAYOUTS:
            out[name, "start"] = run.state_dict(llm=name)
            for adapter in BEFORE_SAVE:
                update_and_check_the_other_stays(run, name, adapter)
        run.save(path)
    with LiveRun(config(tiny, checkpoint=path)) as run:
        for name in LAYOUTS:
            for adapter in AFTER_RESUME:
                update_and_check_the_other_stays(run, name, adapter)
            out[name, "end"] = run.state_dict(llm=name)
            out[name, "scores"] = {a: run.score(CONTEXTS, CANDIDATES, llm=name, peft_adapter=a) for a in "ab"}
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_adapters_trained_in_turn_each_equal_a_plain_peft_model_with_its_own_optimizer(trained, tiny, name):
    start, end = trained[name, "start"], trained[name, "end"]
    expected, clipped = reference(tiny, start, BEFORE_SAVE + AFTER_RESUME, OPTIMIZERS[LAYOUTS[name][0]])
    assert min(clipped) > 2 * CLIP_AFTER_RESUME, clipped  # the resumed run's clipping changes its steps
    moved = 0
    for key, want in expected.items():
        torch.testing.assert_close(end[key], want, atol=1e-4, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
        moved += int((want - start[key]).abs().max() > 1e-3)
    assert moved > len(expected) // 2, "both adapters must move by far more than the tolerance"
    from transformers import AutoTokenizer

    from testkit import reference_scores

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    peft = plain_peft(tiny, end)
    for adapter in "ab":  # scores under each adapter, served after the updates, equal the plain model's
        peft.set_adapter(adapter)
        for got, want in zip(trained[name, "scores"][adapter], reference_scores(peft, tok, CONTEXTS, CANDIDATES)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
