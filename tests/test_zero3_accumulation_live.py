"""Two LoRA adapters trained in the same optimizer steps, one per micro-step (``gradient_accumulation_steps: 2``:
adapter a in the first micro-step, adapter b in the second), equal plain PEFT with plain SGD, under ZeRO 0, 2 and 3.

Under ZeRO-3 DeepSpeed copies a weight's gradient into its partition at the first backward of a step and adds later
ones: a weight whose first gradient of a step came in a later micro-step (adapter b here) used to add it to what the
previous step had left, and trained on that, silently. The trainer now clears ZeRO-3's gradient partitions after
every step. Two updates of two steps each; 1e-5 on every weight.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun, assert_same_training

pytestmark = pytest.mark.slow

PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key"]
CANDIDATES = [[" turn left", " go forward"]] * 4
LR = 0.05


@pytest.fixture(scope="module")
def run(tiny):
    lora = {"plugin": "lora", "args": {"adapters": {"a": {"r": 4}, "b": {"r": 4}}}}
    llms = {f"z{zero}": {"model": tiny["llama"], "initializers": [lora],
                         "updater": "llmrl_test_plugins:AlternatingAdaptersUpdater",
                         "training": {"zero_stage": zero, "optimizer": {"type": "sgd", "lr": LR},
                                      "micro_batch_size": 1, "gradient_accumulation_steps": 2}}
            for zero in (0, 2, 3)}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def plain_updates(tiny, start: dict, batches: list) -> dict:
    """The same updates on a plain PEFT model: per step, adapter a's loss on one prompt, then adapter b's on the
    next, gradients summed, one SGD step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
                           adapter_name="a")
    model.add_adapter("b", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    params = {f"model.{k}": p for k, p in model.named_parameters() if ".lora_" in k}
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(start[key])
            p.requires_grad_(True)
    opt = torch.optim.SGD(list(params.values()), lr=LR)

    def score(prompt: str, candidate: str):
        ctx = tok(prompt)["input_ids"]
        full = tok(prompt + candidate)["input_ids"]
        logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0, :-1].float(), -1)
        return sum(logp[t - 1, full[t]] for t in range(len(ctx), len(full)))

    for weights in batches:
        for first in (0, 2):
            opt.zero_grad()
            for k, adapter in ((first, "a"), (first + 1, "b")):
                model.set_adapter(adapter)
                loss = -sum(w * score(PROMPTS[k], c) for w, c in zip(weights[k], CANDIDATES[k])) / 2
                loss.backward()
            opt.step()
    return {k: p.detach() for k, p in params.items()}


def test_adapters_trained_in_different_micro_steps_of_a_step_equal_plain_peft(run, tiny):
    start = run.state_dict(llm="z0")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 2, generator=g).tolist() for _ in range(2)]
    for weights in batches:
        for name in ("z0", "z2", "z3"):
            run.update(PROMPTS, CANDIDATES, llm=name, weights=weights)
    want = plain_updates(tiny, start, batches)
    for name in ("z0", "z2", "z3"):
        assert_same_training(run.state_dict(llm=name), want, start, atol=1e-5, min_moved=len(want) // 3 + 1,
                             label=f"{name} ")
