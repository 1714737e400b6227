"""``training.gradient_checkpointing: true`` on live servers: one update equals the same update without it (SGD,
learning rate 1, one optimizer step: the weights' change is the gradient) to 1e-6 in float32.

Each case is a pair of LLMs that differ only in that key:

- ``lora``: Llama, LoRA, the per-token value head, ``ppo_tokens``; a token budget of 24 turns packing off, so
  continuation rows attend to their context's key/value cache, written with gradients (the cache the checkpointed
  layers must put back before they are computed again);
- ``trunk``: Llama, LoRA on the top layer only, frozen-trunk reuse (the update replays the bottom layer from what
  scoring recorded, and only the top layer is checkpointed), ``grpo``;
- ``full``: GPT-2, every weight trained, the reward head, ``pairwise_reward``, 2 replicas under ZeRO-3;
- ``t5``: T5, every weight trained, the value head, ``ppo`` (encoder and decoder blocks checkpointed).
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun, assert_same_training

pytestmark = pytest.mark.slow

PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key", "open the door"]
WORDS = [" go to the red ball", " the key", " open the door", " turn left", " a wall", " pick up", " fridge"]


def cases(tiny) -> dict:
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
    top = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4, "last_layers": 1}}}}
    return {
        "lora": {"model": tiny["llama"], "initializers": [lora], "token_budget": 24,
                 "heads": {"value": {"plugin": "token_value", "args": {"hidden": 16}}},
                 "updater": {"plugin": "ppo_tokens", "args": {"entropy_coef": 0.01, "epochs": 1}}},
        "trunk": {"model": tiny["llama"], "initializers": [top], "trunk_reuse_mb": 16,
                  "updater": {"plugin": "grpo", "args": {"kl_coef": 0.1, "epochs": 1}}},
        "full": {"model": tiny["gpt2"], "replicas": 2, "heads": {"reward": "reward"},
                 "updater": {"plugin": "pairwise_reward", "args": {"epochs": 1}}},
        "t5": {"model": tiny["t5"], "type": "seq2seq", "heads": {"value": {"plugin": "value", "args": {"hidden": 8}}},
               "updater": {"plugin": "ppo", "args": {"kl_coef": 0.0, "epochs": 1}}},
    }


@pytest.fixture(scope="module")
def run(tiny):
    llms = {}
    for name, llm in cases(tiny).items():
        zero = 3 if name == "full" else 0
        for on in (False, True):
            training = {"zero_stage": zero, "optimizer": {"type": "sgd", "lr": 1.0}, "micro_batch_size": 8,
                        "gradient_checkpointing": on}
            llms[f"{name}-{'on' if on else 'off'}"] = {**llm, "training": training}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def batch(tiny, name: str) -> tuple[list, dict]:
    from transformers import AutoTokenizer

    g = torch.Generator().manual_seed(1)
    n = len(PROMPTS)
    if name in ("lora", "trunk"):
        tok = AutoTokenizer.from_pretrained(tiny["llama"])
        conts = [[tok.encode(WORDS[(i + j) % len(WORDS)], add_special_tokens=False)[: 2 + (i + j) % 4]
                  for j in range(3)] for i in range(n)]
        return conts, {"rewards": torch.randn(n, 3, generator=g).tolist()}
    if name == "full":
        return [[WORDS[i % 7], WORDS[(i + 2) % 7]] for i in range(n)], {}
    conts = [[WORDS[(i + j) % 7] for j in range(3)] for i in range(n)]
    return conts, {"actions": [i % 3 for i in range(n)], "old_logprobs": [-1.1] * n,
                   "advantages": torch.randn(n, generator=g).tolist(), "returns": torch.randn(n, generator=g).tolist(),
                   "old_values": torch.randn(n, generator=g).tolist()}


@pytest.mark.parametrize("name", ["lora", "trunk", "full", "t5"])
def test_a_checkpointed_update_has_the_gradient_of_the_plain_one(run, tiny, name):
    off, on = f"{name}-off", f"{name}-on"
    before = run.state_dict(llm=off)
    assert all(torch.equal(before[k], v) for k, v in run.state_dict(llm=on).items()), "the pair starts alike"
    candidates, kwargs = batch(tiny, name)
    if name == "trunk":  # scoring records the trunk's states that the update replays
        for llm in (off, on):
            run.score(PROMPTS, candidates, llm=llm)
    want = run.update(PROMPTS, candidates, llm=off, **kwargs)
    got = run.update(PROMPTS, candidates, llm=on, **kwargs)
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys() and mine["optimizer_steps"] == theirs["optimizer_steps"] == 1
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, abs=1e-6, rel=1e-6), key
    assert_same_training(run.state_dict(llm=on), run.state_dict(llm=off), before, atol=1e-6)
    servers, memory = run.servers(), run.server_memory()
    for rank, info in servers.items():
        if info["llm"] in (off, on):
            layers = memory[rank]["checkpointed_layers"]
            assert (layers > 0) == (info["llm"] == on), (info["llm"], layers)
            if name == "trunk":
                assert memory[rank]["trunk"]["replayed_calls"] > 0
