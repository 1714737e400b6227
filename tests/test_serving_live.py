"""Live runs (every rank a process): score, heads and generate through the servers equal plain Hugging
Face and plain PyTorch, with 1 replica (with and without prefix reuse), 2 replicas, tensor-parallel 2 and ZeRO-3
(Llama), and for several model families in one run (Llama, GPT-2, T5, a tokenizer that appends EOS, a seq2seq
model whose decoder start token is only in its generation config). The inputs include boundary merges
(contexts ending in a space or mid-word whose candidates' first characters merge with the context's last
tokens) and an empty context on a BOS model. Generated tokens, scored back as token ids with per-token
log-probs, give generate's log-probs exactly (where the text, re-tokenised, does not)."""

from __future__ import annotations

import os

import pytest
import torch

from llmrl.engine.errors import InvalidArgument, RequestError
from testkit import LiveRun, reference_scores

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE_PLUGINS = os.path.join(os.path.dirname(HERE), "examples", "plugin_package")
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café ", "東京 is", "x x x",
            "In the kitchen you see a fridge.", "You see a wa", "Possible actions: tu", ""]
CANDIDATES = [[" turn left", " turn right", " go forward", "", "Ünïcödé 🙂"],
              ["pick up", " pick up", "  drop"],
              [],
              ["naïve", " über"],
              [f" c{i}" for i in range(20)],
              [" open fridge", " go north"],
              ["ll 2 steps forward", "lk", " red ball"],
              ["rn right", "rn left", "n"],
              [" a", "x"]]
PROBE_HEADS = {"ctx_layers": {"plugin": "llmrl_test_plugins:ContextLayersHead"},
               "cand_layers": {"plugin": "llmrl_test_plugins:CandidateLayersHead"},
               "token_probe": {"plugin": "llmrl_test_plugins:TokenProbeHead"}}
HEADS = {"value": {"plugin": "value", "args": {"hidden": 16}},
         "q": {"plugin": "llmrl_example_plugins:ActionValueHead", "args": {"hidden": 8}},
         **PROBE_HEADS, "bad_rows": {"plugin": "llmrl_test_plugins:BadRowsHead"}}
# Token ids (used as given); the last context's 12 candidates are cut over replicas.
PROBE_CONTEXTS = [[17, 230, 41, 99, 5], [300, 301], [5, 6, 7, 8]]
PROBE_CANDIDATES = [[[7, 8, 9, 10], [7, 8], [311], []], [[1, 2, 3]], [[10 + k, 11 + k, 3] for k in range(12)]]
LAYOUTS = ["single", "noreuse", "replicated", "sharded", "zero3"]


def assert_scores(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu" and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def without_empty(contexts, candidates):
    """Drop the empty context (a model without BOS has nothing to condition its candidates on)."""
    keep = [i for i, c in enumerate(contexts) if c]
    return [contexts[i] for i in keep], [candidates[i] for i in keep]


def reference_logprobs(model, tok, prompt, tokens, seq2seq):
    from testkit.models import decoder_start

    with torch.no_grad():
        if seq2seq:
            dec = [decoder_start(model)] + tokens[:-1]
            logits = model(**tok(prompt, return_tensors="pt"), decoder_input_ids=torch.tensor([dec])).logits[0]
            return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), tokens]
        ids = tok(prompt)["input_ids"]
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        return torch.stack([logp[len(ids) + t - 1, token] for t, token in enumerate(tokens)])


def assert_scored_back(run, llm, prompts, results):
    """Each sample's tokens, scored back as token-id candidates of its prompt (the prompt as text, tokenised as
    generate tokenised it), give exactly its tokens and generate's per-token log-probs."""
    scored = run.score(prompts, [[s["tokens"] for s in samples] for samples in results], llm=llm, per_token=True)
    for samples, got in zip(results, scored):
        for k, sample in enumerate(samples):
            assert torch.equal(got["tokens"][k], sample["tokens"])
            torch.testing.assert_close(got["logprobs"][k], sample["logprobs"], atol=1e-4, rtol=0)
            assert float(got["score"][k]) == pytest.approx(sample["logprob"], abs=1e-4)


def check_generation(run, llm, model, tok, seq2seq):
    """Greedy samples equal plain HF generate; every sample's log-probs equal a plain forward's; every sample's
    tokens scored back as ids give its log-probs (for every tokenizer: the ids are never re-tokenised)."""
    prompts = CONTEXTS[:8]
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
        torch.testing.assert_close(sample["logprobs"], reference_logprobs(model, tok, prompt, plain, seq2seq),
                                   atol=1e-4, rtol=0)
        assert sample["logprob"] == pytest.approx(float(sample["logprobs"].sum()), abs=1e-5)
    assert_scored_back(run, llm, prompts, results)
    first = run.generate(prompts[:2], llm=llm, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=3)
    again = run.generate(prompts[:2], llm=llm, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=3)
    assert [len(s) for s in first] == [3, 3]
    assert [[s["tokens"].tolist() for s in c] for c in first] == [[s["tokens"].tolist() for s in c] for c in again]
    for prompt, samples in zip(prompts[:2], first):
        for s in samples:
            torch.testing.assert_close(s["logprobs"], reference_logprobs(model, tok, prompt, s["tokens"].tolist(),
                                                                         seq2seq), atol=1e-4, rtol=0)
    assert_scored_back(run, llm, prompts[:2], first)


@pytest.fixture(scope="module")
def llama_layouts(tiny):
    """One run: the tiny Llama with value and action-value heads in five layouts (each its own world)."""
    def layout(**extra):
        return {"model": tiny["llama"], "heads": HEADS, **extra}

    config = {"llms": {"single": layout(), "noreuse": layout(prefix_reuse=False), "replicated": layout(replicas=2),
                       "sharded": layout(tensor_parallel=2),
                       "zero3": layout(replicas=2, training={"zero_stage": 3})},
              "threads_per_rank": 1}
    run = LiveRun(config, env={"PYTHONPATH": os.pathsep.join([EXAMPLE_PLUGINS, os.environ.get("PYTHONPATH", "")])})
    yield run
    assert run.close() == 0


def ordinary_pad_id(tiny) -> int:
    """The id of an ordinary token that occurs in the inputs ("x"): padding with it must change nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    chosen = tok("x", add_special_tokens=False)["input_ids"][-1]
    assert chosen not in tok.all_special_ids
    return chosen


@pytest.fixture(scope="module")
def mixed_llms(tiny):
    """One run: Llama (1 replica; eager attention through model_kwargs and an ordinary token as its pad token),
    GPT-2 (2 replicas), T5, and the two variants. The last test closes t5-genstart while the others go on."""
    config = {"llms": {"llama": {"model": tiny["llama"], "model_kwargs": {"attn_implementation": "eager"},
                                 "pad_token_id": ordinary_pad_id(tiny), "heads": PROBE_HEADS},
                       "gpt2": {"model": tiny["gpt2"], "replicas": 2, "heads": PROBE_HEADS},
                       "t5": {"model": tiny["t5"], "type": "seq2seq", "heads": PROBE_HEADS},
                       "llama-eos": {"model": tiny["llama-eos"]},
                       "t5-genstart": {"model": tiny["t5-genstart"], "type": "seq2seq"}},
              "threads_per_rank": 1}
    run = LiveRun(config)
    yield run
    assert run.close() == 0, run.log
    assert run.leftover_processes() == []


@pytest.mark.parametrize("llm", LAYOUTS)
def test_llama_layouts_score_like_plain_hf(llama_layouts, reference_models, llm):
    model, tok = reference_models["llama"]
    assert_scores(llama_layouts.score(CONTEXTS, CANDIDATES, llm=llm),
                  reference_scores(model, tok, CONTEXTS, CANDIDATES))


@pytest.mark.parametrize("llm", LAYOUTS)
def test_heads_equal_plain_pytorch_on_hf_hidden_states(llama_layouts, reference_models, llm):
    """The value head reads the hidden state at the context's last token (the context tokenised alone, even when a
    candidate merges with it), the action-value head at each candidate's last token."""
    import sys

    sys.path.insert(0, EXAMPLE_PLUGINS)
    from llmrl_example_plugins import ActionValueHead

    from llmrl.plugins.contracts import LLMInfo
    from llmrl.plugins.value_head import ValueHead

    model, tok = reference_models["llama"]
    weights = llama_layouts.state_dict(llm=llm, prefix="heads.")
    info = LLMInfo("ref", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    value, q = ValueHead(info, hidden=16), ActionValueHead(info, hidden=8)
    value.load_state_dict({k[len("heads.value."):]: v for k, v in weights.items() if k.startswith("heads.value.")})
    q.load_state_dict({k[len("heads.q."):]: v for k, v in weights.items() if k.startswith("heads.q.")})

    def last_hidden(text):
        ids = torch.tensor([tok(text)["input_ids"]])
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]

    heads_only = llama_layouts.custom_module_fns(["value", "q"], CONTEXTS, CANDIDATES, llm=llm)
    with_scores = llama_layouts.score(CONTEXTS, CANDIDATES, llm=llm, additional_module_function_keys=["q", "value"])
    with torch.no_grad():
        for i, (context, cands) in enumerate(zip(CONTEXTS, CANDIDATES)):
            want_value = value.mlp(last_hidden(context)).squeeze()
            want_q = torch.stack([q.mlp(last_hidden(context + c)).squeeze() for c in cands]) if cands \
                else torch.zeros(0)
            for got in (heads_only[i], with_scores[i]):
                torch.testing.assert_close(got["value"], want_value, atol=1e-4, rtol=0)
                torch.testing.assert_close(got["q"], want_q, atol=1e-4, rtol=0)


@pytest.mark.parametrize("llm", LAYOUTS)
def test_llama_layouts_generate_like_plain_hf(llama_layouts, reference_models, llm):
    model, tok = reference_models["llama"]
    check_generation(llama_layouts, llm, model, tok, seq2seq=False)


@pytest.mark.parametrize("llm", LAYOUTS)
def test_64_sampled_continuations_score_back_exactly_as_token_ids(llama_layouts, reference_models, llm):
    """Sample 8 x 8 continuations; feed their tokens back as id candidates of the same prompt ids with per-token
    log-probs: all 64 give generate's log-probs (1e-4). Some samples decode to a text that re-tokenises to other ids:
    there the string path scores other tokens, whose log-prob differs, while the id path does not."""
    _, tok = reference_models["llama"]
    prompts = CONTEXTS[:8]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    results = llama_layouts.generate(prompt_ids, llm=llm, max_new_tokens=8, do_sample=True, temperature=1.5,
                                     num_return_sequences=8, seed=11)
    assert [len(samples) for samples in results] == [8] * 8
    by_ids = llama_layouts.score(prompt_ids, [[s["tokens"] for s in samples] for samples in results], llm=llm,
                                 per_token=True, entropy=True)
    by_text = llama_layouts.score(prompts, [[s["text"] for s in samples] for samples in results], llm=llm,
                                  per_token=True)
    drifted = 0
    for samples, ids, text in zip(results, by_ids, by_text):
        for k, sample in enumerate(samples):
            assert torch.equal(ids["tokens"][k], sample["tokens"])
            torch.testing.assert_close(ids["logprobs"][k], sample["logprobs"], atol=1e-4, rtol=0)
            assert ids["entropy"][k].shape == sample["tokens"].shape and bool((ids["entropy"][k] > 0).all())
            if not torch.equal(text["tokens"][k], sample["tokens"]):
                drifted += 1
                assert abs(float(text["score"][k]) - sample["logprob"]) > 1e-4
    assert drifted > 0, "no sample re-tokenised differently: the drift the id path avoids was not shown"


@pytest.mark.parametrize("llm", ["zero3", "sharded"])
def test_bad_token_ids_are_refused_and_the_servers_go_on(llama_layouts, reference_models, llm):
    """Ids beyond the vocabulary are refused before anything is sent, named by their place in the whole call (not in
    a replica's share); the next request is right."""
    model, tok = reference_models["llama"]
    vocab = model.config.vocab_size
    contexts = [tok(c)["input_ids"] for c in CONTEXTS[:3]]
    with pytest.raises(InvalidArgument, match=rf"contexts\[2\]\[0\] is {vocab}, not a token id of LLM '{llm}'"):
        llama_layouts.score([contexts[0], contexts[1], [vocab]], [[[5]], [[6]], [[6]]], llm=llm)
    with pytest.raises(InvalidArgument, match=r"candidates\[2\]\[0\]\[1\] is 100000"):
        llama_layouts.score(contexts, [[[5]], [[6]], [[7, 100000]]], llm=llm)
    with pytest.raises(InvalidArgument, match=r"contexts\[0\]\[1\] is 400"):
        llama_layouts.generate([[1, 400]], llm=llm, max_new_tokens=2)
    with pytest.raises(InvalidArgument, match=r"candidates\[0\]\[0\] is a string but contexts\[0\] is a list"):
        llama_layouts.score([[1, 2]], [[" a"]], llm=llm)
    got = llama_layouts.score(contexts, [[[5, 6]], [[7]], [[8, 9, 10]]], llm=llm)
    with torch.no_grad():
        for context, cand, g in zip(contexts, [[5, 6], [7], [8, 9, 10]], got):
            logp = torch.log_softmax(model(input_ids=torch.tensor([context + cand])).logits[0].float(), -1)
            want = sum(logp[len(context) + t - 1, token] for t, token in enumerate(cand))
            assert float(g[0]) == pytest.approx(float(want), abs=1e-4)


def test_tensor_parallel_shards_the_weights(llama_layouts):
    servers = llama_layouts.servers()
    memory = llama_layouts.server_memory()
    sharded = [r for r, s in servers.items() if s["llm"] == "sharded"]
    replicated = [r for r, s in servers.items() if s["llm"] == "replicated"]
    assert [servers[r]["tp_rank"] for r in sharded] == [0, 1]
    assert memory[sharded[0]]["parameter_bytes"] < memory[replicated[0]]["parameter_bytes"]


@pytest.mark.parametrize("llm", ["llama", "gpt2", "t5", "llama-eos", "t5-genstart"])
def test_each_llm_answers_its_own_requests(mixed_llms, reference_models, llm):
    model, tok = reference_models[llm]
    seq2seq = llm.startswith("t5")
    contexts, candidates = (CONTEXTS, CANDIDATES) if llm.startswith("llama") else without_empty(CONTEXTS, CANDIDATES)
    got = mixed_llms.score(contexts, candidates, llm=llm)
    assert_scores(got, reference_scores(model, tok, contexts, candidates, seq2seq=seq2seq))
    check_generation(mixed_llms, llm, model, tok, seq2seq=seq2seq)


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
    contexts, candidates = without_empty(CONTEXTS, CANDIDATES)
    calls = [((contexts, candidates), {"llm": llm}) for llm in ("llama", "gpt2", "t5", "gpt2", "llama")]
    results = mixed_llms.many("score", calls)
    for (_args, kwargs), got in zip(calls, results):
        model, tok = reference_models[kwargs["llm"]]
        assert_scores(got, reference_scores(model, tok, contexts, candidates, seq2seq=kwargs["llm"] == "t5"))
    generated = mixed_llms.many("generate", [((CONTEXTS[:2],), {"llm": llm, "max_new_tokens": 3, "do_sample": False})
                                             for llm in ("llama", "t5")])
    for llm, got in zip(("llama", "t5"), generated):
        alone = mixed_llms.generate(CONTEXTS[:2], llm=llm, max_new_tokens=3, do_sample=False)
        assert [[s["tokens"].tolist() for s in c] for c in got] == [[s["tokens"].tolist() for s in c] for c in alone]
        assert [[s["text"] for s in c] for c in got] == [[s["text"] for s in c] for c in alone]


def test_async_heads(llama_layouts):
    calls = [((["value"], CONTEXTS), {"llm": llm}) for llm in ("single", "sharded")]
    for (args, kwargs), got in zip(calls, llama_layouts.many("custom_module_fns", calls)):
        want = llama_layouts.custom_module_fns(*args, **kwargs)
        assert all(torch.equal(g["value"], w["value"]) for g, w in zip(got, want))


def test_unknown_llm_is_refused_on_the_client(mixed_llms):
    with pytest.raises(ValueError, match="unknown llm 'gtp2' \\(did you mean 'gpt2'\\?\\)"):
        mixed_llms.score(["a"], [["b"]], llm="gtp2")


@pytest.mark.parametrize("llm", ["llama", "t5"])
def test_tokenize_shows_what_score_sums_over(mixed_llms, reference_models, llm):
    _, tok = reference_models[llm]
    plans = mixed_llms.tokenize(CONTEXTS, CANDIDATES, llm=llm)
    merged = 0
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
            merged += got["merged_context_tokens"] > 0
    assert llm == "t5" or merged >= 3, "the inputs must include boundary merges"


# One context over several replicas (issue 12.4): a context with many candidates, or with several sampled return
# sequences, is cut across the replicas; results equal one replica's and plain Hugging Face's.
BIG = ["You see a door. You", "Goal: go to the red ball"]
BIG_CANDIDATES = [[f" {verb} {thing}" for verb in ("open", "take", "push", "look at", "go to", "drop", "kick", "eat")
                   for thing in ("the door", "a key", "the red ball", "a box", "it", "the wall", "north", "café",
                                 "them", "up", "down", "left", "right", "me", "a", "x", "y", "z", "w", "v", "u", "t",
                                 "s", "r", "q", "p", "o", "n", "m", "l", "k", "j")],
                  [" pick up", " go forward", " turn left"]]


def requests_served(run, llm: str, kind: str) -> list[int]:
    """How many requests of ``kind`` each replica leader of ``llm`` received so far."""
    servers, stats = run.servers(), run.server_memory()
    return [stats[r]["requests"].get(kind, 0) for r, s in servers.items() if s["llm"] == llm and s["tp_rank"] == 0]


@pytest.fixture(scope="module")
def big_on_one_replica(llama_layouts, reference_models):
    """Plain Hugging Face scores of BIG, and what one replica returns with normalize and both heads."""
    model, tok = reference_models["llama"]
    one = llama_layouts.score(BIG, BIG_CANDIDATES, llm="single", normalize=True,
                              additional_module_function_keys=["value", "q"])
    return reference_scores(model, tok, BIG, BIG_CANDIDATES), one


@pytest.mark.parametrize("llm", ["replicated", "zero3"])
def test_one_context_with_many_candidates_uses_every_replica(llama_layouts, big_on_one_replica, llm):
    assert [len(c) for c in BIG_CANDIDATES] == [256, 3]
    plain, one = big_on_one_replica
    keys = ["value", "q"]
    served = requests_served(llama_layouts, llm, "score")
    got = llama_layouts.score(BIG, BIG_CANDIDATES, llm=llm, normalize=True, additional_module_function_keys=keys)
    if llm == "replicated":  # (under lockstep every replica receives every request anyway)
        assert [b - a for a, b in zip(served, requests_served(llama_layouts, llm, "score"))] == [1, 1]
    # Against one replica: float32's default tolerance (1e-5 absolute plus 1.3e-6 relative: batches of other shapes
    # round differently). Every LLM builds its heads with the same seed, so their weights are equal.
    for g, o, p in zip(got, one, plain):
        torch.testing.assert_close(g["score"], o["score"], atol=1e-5, rtol=1.3e-6)  # log-softmax over all candidates
        torch.testing.assert_close(g["score"], p.log_softmax(0), atol=1e-4, rtol=0)
        assert g["q"].shape == (len(p),) and g["value"].shape == ()
        torch.testing.assert_close(g["q"], o["q"], atol=1e-5, rtol=1.3e-6)
        torch.testing.assert_close(g["value"], o["value"], atol=1e-5, rtol=1.3e-6)
    assert_scores(llama_layouts.score(BIG[:1], BIG_CANDIDATES[:1], llm=llm), plain[:1])
    heads = llama_layouts.custom_module_fns(keys, BIG, BIG_CANDIDATES, llm=llm)
    for h, o in zip(heads, one):
        torch.testing.assert_close(h["q"], o["q"], atol=1e-5, rtol=1.3e-6)
        torch.testing.assert_close(h["value"], o["value"], atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("llm", ["replicated", "zero3"])
def test_one_prompt_with_eight_samples_uses_every_replica(llama_layouts, reference_models, llm):
    """Sampled return sequences are spread over the replicas: seeded samples come back the same, each sample's
    log-probs are a plain forward's, and sampling that can only pick the best token (top_k=1) equals plain Hugging
    Face greedy decoding on every sample."""
    model, tok = reference_models["llama"]
    prompt = CONTEXTS[0]
    args = {"llm": llm, "max_new_tokens": 4, "do_sample": True, "num_return_sequences": 8}
    served = requests_served(llama_layouts, llm, "generate")
    (first,) = llama_layouts.generate([prompt], seed=11, **args)
    if llm == "replicated":  # (under lockstep every replica receives every request anyway)
        assert [b - a for a, b in zip(served, requests_served(llama_layouts, llm, "generate"))] == [1, 1]
    (again,) = llama_layouts.generate([prompt], seed=11, **args)
    tokens = [s["tokens"].tolist() for s in first]
    assert len(first) == 8 and tokens == [s["tokens"].tolist() for s in again]
    assert tokens[:4] != tokens[4:], "the replicas drew the same samples: their seeds must differ"
    for s in first:
        torch.testing.assert_close(s["logprobs"], reference_logprobs(model, tok, prompt, s["tokens"].tolist(), False),
                                   atol=1e-4, rtol=0)
    with torch.no_grad():
        enc = tok(prompt, return_tensors="pt")
        greedy = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)[0]
    greedy = greedy[enc["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    greedy = greedy[: greedy.index(eos) + 1] if eos in greedy else greedy
    for layout in (llm, "single"):
        (best,) = llama_layouts.generate([prompt], seed=3, top_k=1, **{**args, "llm": layout})
        assert [s["tokens"].tolist() for s in best] == [greedy] * 8


def test_greedy_decoding_with_several_sequences_is_refused_on_every_layout(llama_layouts):
    """Hugging Face refuses greedy decoding with num_return_sequences > 1; a split layout must not turn it into
    eight copies of the greedy sequence (such a call is not cut, so every layout answers alike)."""
    for llm in ("single", "replicated"):
        with pytest.raises(RequestError, match="num_return_sequences"):
            llama_layouts.generate([CONTEXTS[0]], llm=llm, max_new_tokens=2, num_return_sequences=8)


def test_model_kwargs_and_pad_token_id_are_used(mixed_llms, tiny):
    """The served Llama uses the attention implementation given in model_kwargs and pads with the chosen ordinary
    token; its scores equal plain HF loaded with the same keyword (every other test of this run compares it with
    plain HF too: padding with an ordinary token changes nothing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = mixed_llms.info
    assert info["llama"]["attn_implementation"] == "eager" and info["gpt2"]["attn_implementation"] != "eager"
    assert info["llama"]["pad_token_id"] == ordinary_pad_id(tiny)
    eager = AutoModelForCausalLM.from_pretrained(tiny["llama"], attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    assert_scores(mixed_llms.score(CONTEXTS, CANDIDATES, llm="llama"), reference_scores(eager, tok, CONTEXTS,
                                                                                        CANDIDATES))


@pytest.mark.parametrize("llm", ["llama", "gpt2", "t5"])
def test_beam_search_returns_plain_hf_beams_and_scores(mixed_llms, reference_models, llm):
    """num_beams > 1 through the servers (Llama pads with an ordinary token, GPT-2 splits the prompts over 2
    replicas): plain HF's beams, each with its sequences_scores as beam_score and raw-model log-probs."""
    model, tok = reference_models[llm]
    seq2seq = llm == "t5"
    prompts = [c for c in CONTEXTS[:5] if c]
    beams = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 5, "do_sample": False}
    results = mixed_llms.generate(prompts, llm=llm, **beams)
    for prompt, samples in zip(prompts, results):
        with torch.no_grad():
            enc = tok(prompt, return_tensors="pt")
            out = model.generate(**enc, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, **beams)
        plain = out.sequences[:, 1:] if seq2seq else out.sequences[:, enc["input_ids"].shape[1]:]
        eos = model.generation_config.eos_token_id
        plain = [p[: p.index(eos) + 1] if eos in p else p for p in plain.tolist()]
        assert [s["tokens"].tolist() for s in samples] == plain
        for sample, score in zip(samples, out.sequences_scores):
            assert sample["beam_score"] == pytest.approx(float(score), abs=1e-4)
            torch.testing.assert_close(sample["logprobs"], reference_logprobs(model, tok, prompt, sample["tokens"]
                                                                              .tolist(), seq2seq), atol=1e-4, rtol=0)


def plain_hidden(model, seq2seq: bool, context: list[int], tokens: list[int]):
    """One unpadded Hugging Face forward with output_hidden_states (seq2seq: the decoder's): per layer (0, 1, -2,
    -1), the hidden states at the context's last token, at the candidate's last token and at the positions that
    predict each token; and the logits there."""
    with torch.no_grad():
        if seq2seq:
            dec = [model.config.decoder_start_token_id] + tokens
            out = model(input_ids=torch.tensor([context]), decoder_input_ids=torch.tensor([dec]),
                        output_hidden_states=True)
            hs, ctx, cand, toks = out.decoder_hidden_states, 0, len(tokens), list(range(len(tokens)))
        else:
            out = model(input_ids=torch.tensor([context + tokens]), output_hidden_states=True)
            n = len(context)
            hs, ctx, cand, toks = out.hidden_states, n - 1, n + len(tokens) - 1, list(range(n - 1, n - 1 + len(tokens)))
    return {layer: (hs[layer][0, ctx], hs[layer][0, cand], hs[layer][0, toks]) for layer in (0, 1, -2, -1)}, \
        out.logits[0, toks].float()


def check_probe_heads(run, llm: str, model, seq2seq: bool):
    """Heads reading layers 0, 1, -2 and -1 at contexts, candidates and scored tokens, and the logits, return what
    plain Hugging Face's output_hidden_states gives; per-context keyword arguments reach their contexts' heads."""
    close = dict(atol=1e-4, rtol=0)
    scale = [1.0, 2.0, 3.0]
    keys = ["ctx_layers", "cand_layers", "token_probe"]
    heads = run.custom_module_fns(keys, PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm,
                                  head_kwargs={"scale": scale, "offset": 5.0})
    scored = run.score(PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm, additional_module_function_keys=["token_probe"],
                       per_token=True, head_kwargs={"offset": 5.0})
    for i, (context, cands) in enumerate(zip(PROBE_CONTEXTS, PROBE_CANDIDATES)):
        got, tokens = heads[i], heads[i]["token_probe"]
        assert len(tokens["h1"]) == len(cands) and len(scored[i]["token_probe"]["logprob"]) == len(cands)
        for j, cand in enumerate(cands):
            layers, logits = plain_hidden(model, seq2seq, context, cand)
            if j == 0:
                torch.testing.assert_close(got["ctx_layers"]["h0"], layers[0][0], **close)
                torch.testing.assert_close(got["ctx_layers"]["scaled_h1"], scale[i] * layers[1][0], **close)
                torch.testing.assert_close(got["ctx_layers"]["last"], layers[-1][0], **close)
            torch.testing.assert_close(got["cand_layers"]["h0"][j], layers[0][1], **close)
            torch.testing.assert_close(got["cand_layers"]["h_2"][j], layers[-2][1], **close)
            torch.testing.assert_close(tokens["h1"][j], layers[1][2], **close)
            torch.testing.assert_close(tokens["last"][j], layers[-1][2], **close)
            torch.testing.assert_close(tokens["logits"][j], logits, **close)
            torch.testing.assert_close(scored[i]["token_probe"]["logprob"][j], scored[i]["logprobs"][j] + 5.0, **close)
            want = torch.log_softmax(logits, -1)[torch.arange(len(cand)), cand]
            torch.testing.assert_close(scored[i]["logprobs"][j], want, **close)


@pytest.mark.parametrize("llm", LAYOUTS)
def test_heads_read_layers_token_hidden_states_and_logits_like_plain_hf(llama_layouts, reference_models, llm):
    check_probe_heads(llama_layouts, llm, reference_models["llama"][0], seq2seq=False)


@pytest.mark.parametrize("llm", ["llama", "gpt2", "t5"])
def test_heads_read_layers_on_every_family(mixed_llms, reference_models, llm):
    check_probe_heads(mixed_llms, llm, reference_models[llm][0], seq2seq=llm == "t5")


@pytest.mark.parametrize("llm", LAYOUTS)
def test_a_head_output_with_wrong_rows_is_refused_and_the_servers_go_on(llama_layouts, reference_models, llm):
    with pytest.raises(RequestError, match=r"head 'bad_rows' \(llmrl_test_plugins:BadRowsHead\) output\['bad'\] "
                                           r"has shape \(\d, 1\).*level 'candidate'") as caught:
        llama_layouts.custom_module_fns(["bad_rows"], PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm)
    assert caught.value.plugin == "llmrl_test_plugins:BadRowsHead"
    model, tok = reference_models["llama"]
    assert_scores(llama_layouts.score(CONTEXTS[:3], CANDIDATES[:3], llm=llm),
                  reference_scores(model, tok, CONTEXTS[:3], CANDIDATES[:3]))


def test_close_one_llm_while_the_others_serve(mixed_llms, reference_models, tmp_path):
    """Runs last in this module: close_llm stops t5-genstart's rank (it exits, and the run still ends with code 0,
    see the fixture), calls naming it raise LLMClosedError, and the other LLMs go on answering like plain HF."""
    import time

    import psutil

    from llmrl import LLMClosedError

    (closed_rank,) = [r for r, s in mixed_llms.servers().items() if s["llm"] == "t5-genstart"]
    pid = mixed_llms.servers()[closed_rank]["pid"]
    assert mixed_llms.close_llm("t5-genstart") is None
    assert mixed_llms.close_llm("t5-genstart") is None  # closing twice does nothing
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pid):  # exited, and reaped by the launcher (no zombie)
        assert time.monotonic() < deadline, f"the closed rank (pid {pid}) did not exit"
        time.sleep(0.1)
    for call, args in (("score", (CONTEXTS[:1], CANDIDATES[:1])), ("generate", (CONTEXTS[:1],)),
                       ("custom_module_fns", (["value"], CONTEXTS[:1]))):
        with pytest.raises(LLMClosedError, match=r"LLM 't5-genstart' was closed with close_llm\(\)"):
            mixed_llms.call(call, *args, llm="t5-genstart")
    with pytest.raises(LLMClosedError, match="cannot save"):
        mixed_llms.save(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    assert mixed_llms.servers()[closed_rank]["closed"]
    assert closed_rank not in mixed_llms.server_memory()
    contexts, candidates = without_empty(CONTEXTS, CANDIDATES)
    for llm in ("llama", "gpt2", "t5"):
        model, tok = reference_models[llm]
        assert_scores(mixed_llms.score(contexts, candidates, llm=llm),
                      reference_scores(model, tok, contexts, candidates, seq2seq=llm == "t5"))
    model, tok = reference_models["gpt2"]
    check_generation(mixed_llms, "gpt2", model, tok, seq2seq=False)
