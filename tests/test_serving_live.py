"""Live runs through the DeepSpeed launcher: score and generate through the servers equal plain Hugging
Face, with 1 replica, 2 replicas and tensor-parallel 2 (Llama), and with several LLMs in one run."""

from __future__ import annotations

import pytest
import torch

from testkit import reference_scores

pytestmark = pytest.mark.slow

CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café ", "東京 is", "x x x",
            "In the kitchen you see a fridge."]
CANDIDATES = [[" turn left", " turn right", " go forward", "", "Ünïcödé 🙂"],
              ["pick up", " pick up", "  drop"],
              [],
              ["naïve", " über"],
              [f" c{i}" for i in range(20)],
              [" open fridge", " go north"]]


def assert_scores(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu" and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def check_generation(run, llm, model, tok, seq2seq):
    prompts = CONTEXTS[:4]
    results = run.generate(prompts, llm=llm, max_new_tokens=5, do_sample=False)
    for prompt, samples in zip(prompts, results):
        (sample,) = samples
        with torch.no_grad():
            enc = tok(prompt, return_tensors="pt")
            plain = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)[0]
        plain = (plain[1:] if seq2seq else plain[enc["input_ids"].shape[1]:]).tolist()
        eos = model.generation_config.eos_token_id
        plain = plain[: plain.index(eos) + 1] if eos in plain else plain
        assert sample["tokens"].tolist() == plain
        assert sample["logprob"] == pytest.approx(float(sample["logprobs"].sum()), abs=1e-5)
        if seq2seq:
            continue
        # The generated log-probs agree with score() of the same continuation when it re-tokenises the same way.
        full = tok(prompt + sample["text"])["input_ids"]
        if full[len(enc["input_ids"][0]):] == plain:
            (score,) = run.score([prompt], [[sample["text"]]], llm=llm)
            assert float(score[0]) == pytest.approx(float(sample["logprobs"].sum()), abs=1e-4)
    sampled = run.generate(prompts[:2], llm=llm, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=3)
    assert [len(s) for s in sampled] == [3, 3]


@pytest.fixture(scope="module")
def llama_layouts(tiny):
    """One run: the tiny Llama with 2 replicas, and again with tensor-parallel 2 (two isolated worlds)."""
    from testkit import LiveRun

    config = {"llms": {"replicated": {"model": tiny["llama"], "replicas": 2},
                       "sharded": {"model": tiny["llama"], "tensor_parallel": 2}},
              "threads_per_rank": 1}
    run = LiveRun(config)
    yield run
    run.close()


@pytest.fixture(scope="module")
def mixed_llms(tiny):
    """One run: Llama (1 replica), GPT-2 (2 replicas) and T5 (1 replica)."""
    from testkit import LiveRun

    config = {"llms": {"llama": {"model": tiny["llama"]}, "gpt2": {"model": tiny["gpt2"], "replicas": 2},
                       "t5": {"model": tiny["t5"], "type": "seq2seq"}},
              "threads_per_rank": 1}
    run = LiveRun(config)
    yield run
    run.close()


@pytest.mark.parametrize("llm", ["replicated", "sharded"])
def test_llama_layouts_score_like_plain_hf(llama_layouts, reference_models, llm):
    model, tok = reference_models["llama"]
    assert_scores(llama_layouts.score(CONTEXTS, CANDIDATES, llm=llm), reference_scores(model, tok, CONTEXTS, CANDIDATES))


@pytest.mark.parametrize("llm", ["replicated", "sharded"])
def test_llama_layouts_generate_like_plain_hf(llama_layouts, reference_models, llm):
    model, tok = reference_models["llama"]
    check_generation(llama_layouts, llm, model, tok, seq2seq=False)


def test_tensor_parallel_shards_the_weights(llama_layouts):
    servers = llama_layouts.servers()
    memory = llama_layouts.server_memory()
    sharded = [r for r, s in servers.items() if s["llm"] == "sharded"]
    replicated = [r for r, s in servers.items() if s["llm"] == "replicated"]
    assert [servers[r]["tp_rank"] for r in sharded] == [0, 1]
    assert memory[sharded[0]]["parameter_bytes"] < memory[replicated[0]]["parameter_bytes"]


@pytest.mark.parametrize("llm", ["llama", "gpt2", "t5"])
def test_each_llm_answers_its_own_requests(mixed_llms, reference_models, llm):
    model, tok = reference_models[llm]
    contexts, candidates = CONTEXTS, CANDIDATES
    got = mixed_llms.score(contexts, candidates, llm=llm)
    assert_scores(got, reference_scores(model, tok, contexts, candidates, seq2seq=(llm == "t5")))
    check_generation(mixed_llms, llm, model, tok, seq2seq=(llm == "t5"))


def test_default_llm_is_the_first(mixed_llms, reference_models):
    model, tok = reference_models["llama"]
    assert_scores(mixed_llms.score(CONTEXTS[:2], CANDIDATES[:2]), reference_scores(model, tok, CONTEXTS[:2],
                                                                                  CANDIDATES[:2]))


def test_score_options(mixed_llms, reference_models):
    model, tok = reference_models["gpt2"]
    contexts, candidates = CONTEXTS[:2], CANDIDATES[:2]
    plain = reference_scores(model, tok, contexts, candidates)
    policy = mixed_llms.score(contexts, candidates, llm="gpt2", normalize=True, probabilities=True)
    for p, e in zip(policy, plain):
        torch.testing.assert_close(p, torch.softmax(e, 0), atol=1e-4, rtol=0)
    mean = mixed_llms.score(contexts, candidates, llm="gpt2", reduction="mean")
    counts = [[max(1, len(tok(c + x)["input_ids"]) - len(tok(c)["input_ids"])) for x in cands]
              for c, cands in zip(contexts, candidates)]
    for m, e, n in zip(mean, plain, counts):
        torch.testing.assert_close(m, e / torch.tensor(n, dtype=torch.float32), atol=1e-4, rtol=0)


def test_empty_requests(mixed_llms):
    assert mixed_llms.score([], []) == []
    (empty,) = mixed_llms.score(["a context"], [[]], llm="t5")
    assert empty.shape == (0,)


def test_async_requests_to_several_llms_run_together(mixed_llms, reference_models):
    calls = [((CONTEXTS, CANDIDATES), {"llm": llm}) for llm in ("llama", "gpt2", "t5", "gpt2", "llama")]
    results = mixed_llms.many("score", calls)
    for (_args, kwargs), got in zip(calls, results):
        model, tok = reference_models[kwargs["llm"]]
        assert_scores(got, reference_scores(model, tok, CONTEXTS, CANDIDATES, seq2seq=kwargs["llm"] == "t5"))


def test_unknown_llm_is_refused_on_the_client(mixed_llms):
    with pytest.raises(ValueError, match="unknown llm 'gtp2' \\(did you mean 'gpt2'\\?\\)"):
        mixed_llms.score(["a"], [["b"]], llm="gtp2")


@pytest.mark.parametrize("llm", ["llama", "t5"])
def test_tokenize_shows_what_score_sums_over(mixed_llms, reference_models, llm):
    _, tok = reference_models[llm]
    plans = mixed_llms.tokenize(CONTEXTS, CANDIDATES, llm=llm)
    for context, cands, plan in zip(CONTEXTS, CANDIDATES, plans):
        ctx_ids = tok(context)["input_ids"]
        assert plan["ids"] == ctx_ids and plan["tokens"] == tok.convert_ids_to_tokens(ctx_ids)
        for cand, got in zip(cands, plan["candidates"]):
            if llm == "t5":  # the decoder target is the candidate tokenised alone
                assert got["ids"] == tok(cand)["input_ids"] and got["merged_context_tokens"] == 0
                continue
            full = tok(context + cand)["input_ids"]
            p = next((k for k, (a, b) in enumerate(zip(ctx_ids, full)) if a != b), min(len(ctx_ids), len(full)))
            assert got["ids"] == full[p:] and got["merged_context_tokens"] == len(ctx_ids) - p
