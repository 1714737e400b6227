"""``training.max_tokens_per_micro_batch``: an update whose micro-batches are trained on in passes of at most 16 tokens
equals, to 1e-5 in float32, the same update in one pass per micro-batch (weights, momentum, every statistic).

Each built-in updater runs on two LLMs of one live run that differ only in that key: ``whole`` (a budget no
micro-batch reaches) and ``split`` (16 tokens, the smallest allowed: GRPO and PPO groups are spread over several
passes, contexts are encoded again in each, replicas with uneven shares replay different numbers of passes).

- ``grpo``: 2 replicas, ZeRO-3, LoRA, sequence normalisation, KL to the base model, entropy bonus;
- ``ppo_tokens``: 2 replicas, ZeRO-2, LoRA, the per-token value head;
- ``ppo``: 1 replica, ZeRO-0, LoRA, the context-level value head (its gradient is taken once per context);
- ``pairwise_reward``: 1 replica, ZeRO-2, the reward head, every weight trained;
- a test updater with two forwards before each backward, the second inside ``trainer.adapters_disabled()``
  (its replay must run without the adapters too): 2 replicas, ZeRO-3.

The optimizer is SGD with momentum: after two updates the weights equal only if the momentum buffers did. Each pair
starts from the same weights (checked), and every test checks that the weights moved.
"""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun, assert_same_training

pytestmark = pytest.mark.slow

PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key", "open the door"]
WORDS = [" go to the red ball", " the key", " open the door", " turn left", " a wall", " pick up", " fridge"]
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
UPDATERS = {
    "grpo": ({"plugin": "grpo", "args": {"kl_coef": 0.1, "entropy_coef": 0.01, "epochs": 2}}, 2, 3, [LORA], {}),
    "ppo_tokens": ({"plugin": "ppo_tokens", "args": {"entropy_coef": 0.01, "epochs": 2}}, 2, 2, [LORA],
                   {"value": {"plugin": "token_value", "args": {"hidden": 16}}}),
    "ppo": ({"plugin": "ppo", "args": {"kl_coef": 0.1, "epochs": 2, "seed": 3}}, 1, 0, [LORA],
            {"value": {"plugin": "value", "args": {"hidden": 8}}}),
    "pairwise_reward": ("pairwise_reward", 1, 2, [], {"reward": "reward"}),
    # two forwards per backward (the second inside adapters_disabled(), replayed the same way), uneven shares
    "two_forwards": ("llmrl_test_plugins:PolicyThenBaseValueUpdater", 2, 3, [LORA],
                     {"value": {"plugin": "token_value", "args": {"hidden": 8}}}),
}


def llm(tiny, name: str, budget: int) -> dict:
    updater, replicas, zero, initializers, heads = UPDATERS[name]
    training = {"zero_stage": zero, "optimizer": {"type": "sgd", "lr": 0.01, "momentum": 0.9},
                "micro_batch_size": 2, "max_tokens_per_micro_batch": budget}
    return {"model": tiny["llama"], "replicas": replicas, "initializers": initializers, "heads": heads,
            "updater": updater, "training": training}


@pytest.fixture(scope="module")
def run(tiny):
    llms = {}
    for name in UPDATERS:
        llms[f"{name}-whole"] = llm(tiny, name, 100_000)
        llms[f"{name}-split"] = llm(tiny, name, 16)
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


def continuations(tiny, per_prompt: int, offset: int) -> list[list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    return [[tok.encode(WORDS[(i + j + offset) % len(WORDS)], add_special_tokens=False)[: 2 + (i + j) % 4]
             for j in range(per_prompt)] for i in range(len(PROMPTS))]


def batches(tiny, name: str) -> list[tuple[list, dict]]:
    """Two update batches (candidates, per-sample keyword arguments) for the updater ``name``."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(2):
        if name in ("grpo", "ppo_tokens"):
            k = 3 if name == "grpo" else 2
            conts = continuations(tiny, k, offset=step)
            out.append((conts, {"rewards": torch.randn(len(PROMPTS), k, generator=g).tolist()}))
        elif name == "two_forwards":
            conts = continuations(tiny, 2, offset=step)
            out.append((conts, {"weights": torch.randn(len(PROMPTS), 2, generator=g).tolist()}))
        elif name == "ppo":
            conts = [[WORDS[(i + j + step) % len(WORDS)] for j in range(3)] for i in range(len(PROMPTS))]
            n = len(PROMPTS)
            out.append((conts, {"actions": [i % 3 for i in range(n)], "old_logprobs": [-1.1] * n,
                                "advantages": torch.randn(n, generator=g).tolist(),
                                "returns": torch.randn(n, generator=g).tolist(),
                                "old_values": torch.randn(n, generator=g).tolist()}))
        else:
            pairs = [[WORDS[(i + step) % len(WORDS)], WORDS[(i + step + 2) % len(WORDS)]] for i in range(len(PROMPTS))]
            out.append((pairs, {}))
    return out


@pytest.mark.parametrize("name", list(UPDATERS))
def test_an_update_in_passes_of_16_tokens_equals_the_update_in_one_pass(run, tiny, name):
    whole, split = f"{name}-whole", f"{name}-split"
    start = run.state_dict(llm=whole)
    assert all(torch.equal(start[k], v) for k, v in run.state_dict(llm=split).items()), "the pair starts alike"
    for candidates, kwargs in batches(tiny, name):
        want = run.update(PROMPTS, candidates, llm=whole, **kwargs)
        got = run.update(PROMPTS, candidates, llm=split, **kwargs)
        assert len(got) == len(want)
        for mine, theirs in zip(got, want):
            assert mine.keys() == theirs.keys()
            assert mine.pop("passes_with_gradients") > theirs.pop("passes_with_gradients"), "the split run split"
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, abs=1e-5, rel=1e-5), (key, mine, theirs)
    assert_same_training(run.state_dict(llm=split), run.state_dict(llm=whole), start, atol=1e-5)


def test_a_sample_longer_than_the_model_accepts_is_refused_by_its_index_and_nothing_trains(run):
    from llmrl.engine.errors import RequestError

    before = run.state_dict(llm="grpo-split")
    conts = [[[5, 6], [7, 8]], [[9] * 600, [10, 11]], [[5], [6]]]
    with pytest.raises(RequestError, match=r"sample 1 of the update call: .*candidate 0 is \d+ tokens long; this "
                                           r"model accepts at most 512.*nothing was trained"):
        run.update(PROMPTS[:3], conts, llm="grpo-split", rewards=[[0.0, 1.0]] * 3)
    after = run.state_dict(llm="grpo-split")
    assert all(torch.equal(before[k], after[k]) for k in before)
