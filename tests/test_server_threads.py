"""Intra-op threads of a server rank: a ZeRO-3 rank loads and sets up on one thread, then serves on its configured
number, so that the gloo threads ZeRO-3's set-up uses never start OpenMP teams of their own (which makes GNU
OpenMP stop spin-waiting in every team: on 2 CPUs a ZeRO-3 rank's generate took 1.4x a ZeRO-2 rank's); and such a
rank, a ZeRO-3 group of one, keeps its decoding packs from call to call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.model.decoding.packed_linears import available
from llmrl.engine.server.replica import Replica, _serial_until_setup
from testkit import LiveRun

LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}


def _llm(stage: int):
    return SimpleNamespace(training=SimpleNamespace(zero_stage=stage))


def test_a_zero3_rank_sets_up_on_one_thread_and_gets_its_threads_back_even_on_failure(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _serial_until_setup(_llm(2)) is None and torch.get_num_threads() == 2
        assert _serial_until_setup(_llm(3)) == 2 and torch.get_num_threads() == 1
        replica = Replica.__new__(Replica)
        replica.threads_after_setup = 2

        def failing(self, plugins):
            raise RuntimeError("set-up failed")

        monkeypatch.setattr(Replica, "_setup", failing)
        with pytest.raises(RuntimeError, match="set-up failed"):
            replica.setup({})
        assert torch.get_num_threads() == 2 and replica.threads_after_setup is None
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_zero3_rank_serves_on_its_configured_threads_and_keeps_its_packs(tiny):
    """(Whether gloo's threads start OpenMP teams shows only with weights large enough for parallel copies: measured
    with ``benchmarks.zero3_serving``, not here.)"""
    llms = {"z3": {"model": tiny["llama"], "initializers": [LORA], "trainable": True,
                   "training": {"zero_stage": 3, "optimizer": {"type": "adam", "lr": 1e-4}}}}
    with LiveRun({"llms": llms, "threads_per_rank": 2}) as run:
        run.generate(["You see a door."], llm="z3", max_new_tokens=3, do_sample=False)
        (rank, _), = run.servers().items()
        first = run.server_memory()[rank]
        assert first["threads"] == 2
        if available("onednn") or available("mkl"):
            # a group of one rank: each gathered weight is its own shard, so its decoding packs outlive the call
            run.generate(["You see a door."], llm="z3", max_new_tokens=3, do_sample=False)
            again = run.server_memory()[rank]["decoding"]
            assert first["decoding"]["weights_packed"] > 0 and again["packed_weights_mb"] > 0, again
            assert again["weights_packed"] == first["decoding"]["weights_packed"], "packed again at the next call"
        # right after an optimizer step (which leaves DeepSpeed's small weights whole), calls view the trained shards
        from llmrl import completion_datum
        from testkit.serving import assert_scored_back

        prompts = ["You see a door.", "Go north."]
        before = run.score(prompts, [[" open it", " wait"]] * 2, llm="z3")
        ids = [t["ids"] for t in run.tokenize(prompts, llm="z3")]
        data = [completion_datum(i, [5, 6, 7], advantages=1.0, logprobs=[-1.0] * 3) for i in ids]
        run.forward_backward(data, "importance_sampling", llm="z3")
        run.optim_step({"learning_rate": 0.5}, llm="z3")
        after = run.score(prompts, [[" open it", " wait"]] * 2, llm="z3")
        assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-4, "the step changed nothing"
        assert_scored_back(run, "z3", prompts, run.generate(prompts, llm="z3", max_new_tokens=3, do_sample=False))
