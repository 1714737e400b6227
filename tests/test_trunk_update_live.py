"""The frozen trunk of a token-level update computed once, by its first pass (issue 33, item 2): ``ppo_tokens`` and
``grpo`` on generated tokens that no ``score`` call ever computed, with LoRA on the top layer of two and
``trunk_reuse_mb``, against the same LLM without it (its twin in the same run; both equal a plain PEFT step in
``test_rlhf_live``): statistics and every weight after two SGD updates equal to 1e-5 (Adam would magnify float32
rounding in near-zero gradients), and the servers report passes
replayed through the top layer only: ``ppo_tokens`` on 2 replicas, ``grpo`` on 1. The frozen layers multiply through
oneDNN (``cpu_matmul``) where this torch has it. An adapter created at run time over the trunk adapts the layers above
it only, and trains as the same adapter on the twin."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.decoding.packed_linears import available
from testkit import LiveRun

pytestmark = pytest.mark.slow

PROMPTS = ["Goal: go to the red ball", "You see a wall 2 steps forward.", "In the kitchen you see a fridge.",
           "pick up the key", "open the door"]
TOP_LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4, "last_layers": 1}}}}
UPDATERS = {
    "ppo_tokens": ({"epochs": 2, "clip_eps": 0.2, "value_clip": 0.05, "value_coef": 0.5, "entropy_coef": 0.01,
                    "kl_coef": 0.1, "gamma": 0.95, "lam": 0.9},
                   {"value": {"plugin": "token_value", "args": {"hidden": 16}}}),
    "grpo": ({"epochs": 2, "clip_eps": 0.2, "kl_coef": 0.1}, {}),
}
CASES = [("ppo_tokens", 2), ("grpo", 1)]  # each updater once; 1 and 2 replicas


@pytest.fixture(scope="module")
def run(tiny):
    llms = {}
    for updater, replicas in CASES:
        args, heads = UPDATERS[updater]
        for kind in ("trunk", "whole"):
            llms[f"{updater}-{replicas}-{kind}"] = {
                "model": tiny["llama"], "replicas": replicas, "trunk_reuse_mb": 16 if kind == "trunk" else 0,
                "initializers": [TOP_LORA], "heads": heads, "updater": {"plugin": updater, "args": args},
                "training": {"zero_stage": 2, "optimizer": {"type": "sgd", "lr": 0.05}, "micro_batch_size": 2}}
    # oneDNN's products for the frozen layers where this torch has it (cpu_matmul; auto takes it on AMD CPUs only)
    live = LiveRun({"llms": llms, "threads_per_rank": 1, "cpu_matmul": "onednn" if available("onednn") else "auto"})
    yield live
    assert live.close() == 0, live.log


@pytest.mark.parametrize("updater,replicas", CASES)
def test_an_update_computes_the_trunk_once_and_equals_the_whole_model(run, updater, replicas):
    trunk, whole = f"{updater}-{replicas}-trunk", f"{updater}-{replicas}-whole"
    start = run.state_dict(llm=whole)
    for step in range(2):  # the second update's samples are new again: its first pass records them
        samples = run.generate(PROMPTS, llm=whole, do_sample=True, num_return_sequences=3, max_new_tokens=5,
                               seed=step)
        conts = [[s["tokens"].tolist() for s in group] for group in samples]
        rewards = [[float(len(c) % 3) - 0.5 * j + 0.1 * i for j, c in enumerate(group)]
                   for i, group in enumerate(conts)]
        got = run.update(PROMPTS, conts, llm=trunk, rewards=rewards)
        want = run.update(PROMPTS, conts, llm=whole, rewards=rewards)
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-5), key
    a, b = run.state_dict(llm=trunk), run.state_dict(llm=whole)
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    moved = [k for k in b if not torch.equal(b[k], start[k])]
    assert moved and all("lora_" in k or k.startswith("heads.") for k in moved), moved  # the top layer's adapter
    ranks = [rank for rank, server in run.servers().items() if server["llm"] == trunk]
    stats = [run.server_memory()[rank]["trunk"] for rank in ranks]
    assert len(stats) == replicas and all(s["replayed_calls"] > 0 for s in stats), stats  # the top layer only
    if available("onednn"):  # the frozen layers' products and input gradients ran through oneDNN
        assert all(run.server_memory()[rank]["cpu_matmul"]["onednn_products"] > 0 for rank in ranks)


@pytest.mark.parametrize("updater,replicas", CASES)
def test_samples_the_llm_generated_leave_it_their_trunk(run, updater, replicas):
    """Samples from the trunk LLM's own ``generate``: its decoding loop kept their states below the adapted layer,
    so the update's first pass replays too (no call runs whole), and the update still equals the whole model's.
    Four prompts of three samples: ``generate`` shares the 12 samples among replicas as ``update`` shares the four
    prompts (a replica updating a sample another replica generated runs that call whole, as before)."""
    trunk, whole = f"{updater}-{replicas}-trunk", f"{updater}-{replicas}-whole"
    prompts = PROMPTS[:4]
    ranks = [rank for rank, server in run.servers().items() if server["llm"] == trunk]
    before = [run.server_memory()[rank]["trunk"]["whole_calls"] for rank in ranks]
    samples = run.generate(prompts, llm=trunk, do_sample=True, num_return_sequences=3, max_new_tokens=5, seed=11)
    conts = [[s["tokens"].tolist() for s in group] for group in samples]
    rewards = [[float(len(c) % 3) - 0.4 * j + 0.1 * i for j, c in enumerate(group)] for i, group in enumerate(conts)]
    got = run.update(prompts, conts, llm=trunk, rewards=rewards)
    want = run.update(prompts, conts, llm=whole, rewards=rewards)
    for g, w in zip(got, want):
        for key in w:
            assert g[key] == pytest.approx(w[key], abs=1e-5), key
    a, b = run.state_dict(llm=trunk), run.state_dict(llm=whole)
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    memory = run.server_memory()
    assert [memory[rank]["trunk"]["whole_calls"] for rank in ranks] == before
    # the servers decoded with the written-out step (its trunk capture included), a value head's hooks in place
    assert all(memory[rank]["decoding"]["llama_step_batches"] > 0 for rank in ranks), memory


def test_an_adapter_created_at_run_time_adapts_the_layers_above_the_trunk_only(run):
    """With ``trunk_reuse_mb`` a new adapter's default targets (attention and MLP) are taken from the trunk's depth up,
    so the states the trunk keeps stay exact: its ``forward_backward`` and step equal those of the same adapter made
    on the LLM without the trunk by naming those modules (to 1e-5); a module name below the trunk is refused by name
    and the servers go on."""
    from llmrl.engine.errors import RequestError
    from llmrl.engine.model.reuse.trunk import layer_of

    trunk, whole = "grpo-1-trunk", "grpo-1-whole"
    run.create_adapter("t", llm=trunk, rank=2, seed=3)
    made = [k for k in run.state_dict(llm=trunk) if ".lora_A.t." in k]
    depth = min(layer_of(k) for k in made)
    assert depth == 1 and made, made  # LoRA's last_layers: 1 of the tiny model's 2 layers
    modules = sorted(k[k.index("layers."):k.index(".lora_A.")] for k in made)
    run.create_adapter("t", llm=whole, rank=2, seed=3, targets=modules)
    g = torch.Generator().manual_seed(0)
    data = []
    for n in (9, 6):
        tokens = torch.randint(3, 100, (n,), generator=g).tolist()
        data.append({"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:],
                                                                     "weights": [1.0] * (n - 1)}})
    got = {llm: run.forward_backward(data, "cross_entropy", llm=llm, peft_adapter="t") for llm in (trunk, whole)}
    assert got[trunk]["metrics"]["loss:sum"] == pytest.approx(got[whole]["metrics"]["loss:sum"], abs=1e-5)
    for llm in (trunk, whole):
        run.optim_step({"learning_rate": 0.05}, llm=llm, peft_adapter="t")
    a, b = run.state_dict(llm=trunk), run.state_dict(llm=whole)
    assert sorted(k for k in a if ".t." in k) == sorted(k for k in b if ".t." in k)
    for key in (k for k in b if ".t." in k):
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    with pytest.raises(RequestError, match=r"layers\.0\.self_attn\.q_proj is in layer 0, below layer 1"):
        run.create_adapter("u", llm=trunk, rank=2, targets=["q_proj"])
    for llm in (trunk, whole):
        run.delete_adapter("t", llm=llm)
