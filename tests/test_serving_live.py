"""Live runs (every rank a process): score, heads and generate through the servers equal plain Hugging Face and plain
PyTorch, with 1 replica (with and without prefix reuse), 2 replicas, tensor-parallel 2 and ZeRO-3 (Llama). The
inputs include boundary merges (contexts ending in a space or mid-word whose candidates' first characters merge with
the context's last tokens) and an empty context on a BOS model. Generated tokens, scored back as token ids with
per-token log-probs, give generate's log-probs exactly (where the text, re-tokenised, does not)."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from llmrl.engine.errors import InvalidArgument, RequestError
from llmrl.engine.model.decoding.packed_linears import available
from testkit import LiveRun, reference_scores
from testkit.serving import (
    CANDIDATES,
    CONTEXTS,
    PROBE_CANDIDATES,
    PROBE_CONTEXTS,
    PROBE_HEADS,
    assert_scores,
    check_generation,
    check_probe_heads,
    reference_logprobs,
    requests_served,
)

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE_PLUGINS = os.path.join(os.path.dirname(HERE), "examples", "plugin_package")
HEADS = {"value": {"plugin": "value", "args": {"hidden": 16}},
         "q": {"plugin": "llmrl_example_plugins:ActionValueHead", "args": {"hidden": 8}},
         **PROBE_HEADS, "bad_rows": {"plugin": "llmrl_test_plugins:BadRowsHead"},
         "policy_entropy": "llmrl_test_plugins:PolicyEntropyHead", "bonus": "llmrl_test_plugins:CandidateBonusHead"}
LAYOUTS = ["single", "noreuse", "replicated", "sharded", "zero3"]
BIG = ["You see a door. You", "Goal: go to the red ball"]
BIG_CANDIDATES = [[f" {verb} {thing}" for verb in ("open", "take", "push", "look at", "go to", "drop", "kick", "eat")
                   for thing in ("the door", "a key", "the red ball", "a box", "it", "the wall", "north", "café",
                                 "them", "up", "down", "left", "right", "me", "a", "x", "y", "z", "w", "v", "u", "t",
                                 "s", "r", "q", "p", "o", "n", "m", "l", "k", "j")],
                  [" pick up", " go forward", " turn left"]]


@pytest.fixture(scope="module")
def llama_layouts(tiny):
    """One run: the tiny Llama with value and action-value heads in five layouts (each its own world)."""
    def layout(**extra):
        return {"model": tiny["llama"], "heads": HEADS, **extra}

    config = {"llms": {"single": layout(), "noreuse": layout(prefix_reuse=False), "replicated": layout(replicas=2),
                       "sharded": layout(tensor_parallel=2),
                       "zero3": layout(replicas=2, training={"zero_stage": 3})},
              "threads_per_rank": 1, "cpu_matmul": "onednn" if available("onednn") else "auto"}
    run = LiveRun(config, env={"PYTHONPATH": os.pathsep.join([EXAMPLE_PLUGINS, os.environ.get("PYTHONPATH", "")])})
    yield run
    assert run.close() == 0


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


def test_every_rank_reports_its_host_allocator(llama_layouts):
    """The config's default ``host_malloc: reuse`` reached every server rank's start-up (run_server), on glibc."""
    memory = llama_layouts.server_memory()
    expected = ("host allocator: blocks up to 32 MB reuse freed memory (host_malloc: reuse)"
                if platform.libc_ver()[0] == "glibc" else "host allocator left as it is: the C library is not glibc")
    assert memory and all(m["host_allocator"] == expected for m in memory.values())


@pytest.mark.skipif(not available("onednn"), reason="this torch build has no oneDNN")
def test_every_rank_multiplies_frozen_weights_through_onednn_as_configured(llama_layouts):
    """``cpu_matmul: onednn`` reached every rank; its scoring passes (whose scores equal plain HF's in the tests above)
    ran their frozen products through oneDNN (tensor-parallel layers are DeepSpeed's own and keep theirs)."""
    llama_layouts.score(CONTEXTS, CANDIDATES, llm="single")
    memory = llama_layouts.server_memory()
    assert memory and all(m["cpu_matmul"]["onednn"] for m in memory.values())
    single = [r for r, s in llama_layouts.servers().items() if s["llm"] == "single"]
    assert memory[single[0]]["cpu_matmul"]["onednn_products"] > 0


def test_zero3_gathers_the_weights_once_per_call_and_partitions_them_again(llama_layouts, reference_models):
    """``score`` and ``generate`` under ZeRO-3 gather every weight once per call on each rank of the group (not layer
    by layer at each forward and decoding step), give plain Hugging Face's results, and leave the weights
    partitioned after (half the replicated copy's bytes on each rank), with no packed copy of the gathered weights
    kept."""
    servers, model_tok = llama_layouts.servers(), reference_models["llama"]
    ranks = [r for r, s in servers.items() if s["llm"] == "zero3"]
    replicated = [r for r, s in servers.items() if s["llm"] == "replicated"]
    before = llama_layouts.server_memory()
    assert_scores(llama_layouts.score(CONTEXTS, CANDIDATES, llm="zero3"), reference_scores(*model_tok, CONTEXTS,
                                                                                           CANDIDATES))
    check_generation(llama_layouts, "zero3", *model_tok, seq2seq=False)
    after = llama_layouts.server_memory()
    calls = [after[r]["zero3_gathered_calls"] - before[r]["zero3_gathered_calls"] for r in ranks]
    assert calls[0] == calls[1] and calls[0] >= 2, calls  # the score call, and check_generation's generate calls
    assert all(after[r]["parameter_bytes"] < 0.75 * after[replicated[0]]["parameter_bytes"] for r in ranks)
    if available("onednn") or available("mkl"):  # decoded with packed weights, whose packs went with the gather
        decoding = [after[r]["decoding"] for r in ranks]
        assert all(d["weights_packed"] > 0 and d["packed_weights_mb"] == 0 for d in decoding), decoding


def test_async_heads(llama_layouts):
    calls = [((["value"], CONTEXTS), {"llm": llm}) for llm in ("single", "sharded")]
    for (args, kwargs), got in zip(calls, llama_layouts.many("custom_module_fns", calls)):
        want = llama_layouts.custom_module_fns(*args, **kwargs)
        assert all(torch.equal(g["value"], w["value"]) for g, w in zip(got, want))


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
def test_heads_see_every_candidate_of_their_context_on_any_number_of_replicas(llama_layouts, reference_models, llm):
    """A costly context's candidates are spread over the replicas, but not in a call with heads: a head may read a
    context's candidates together (a softmax over them) or index per-candidate values. A review found the entropy of
    the policy 0.072 where 0.089 was due, its probabilities summing to 2, and per-candidate values misplaced."""
    model, tok = reference_models["llama"]
    log_pi = [p.log_softmax(0) for p in reference_scores(model, tok, BIG, BIG_CANDIDATES)]
    bonus = [[100 * i + j for j in range(len(c))] for i, c in enumerate(BIG_CANDIDATES)]
    got = llama_layouts.score(BIG, BIG_CANDIDATES, llm=llm, additional_module_function_keys=["policy_entropy", "bonus"],
                              head_kwargs={"bonus": bonus})
    for g, want, given in zip(got, log_pi, bonus):
        torch.testing.assert_close(g["policy_entropy"], -(want.exp() * want).sum(), atol=1e-4, rtol=0)
        torch.testing.assert_close(g["bonus"][:, 0], want, atol=1e-4, rtol=0)
        assert g["bonus"][:, 1].tolist() == given


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


@pytest.mark.parametrize("llm", LAYOUTS)
def test_heads_read_layers_token_hidden_states_and_logits_like_plain_hf(llama_layouts, reference_models, llm):
    check_probe_heads(llama_layouts, llm, reference_models["llama"][0], seq2seq=False)


@pytest.mark.parametrize("llm", LAYOUTS)
def test_a_head_output_with_wrong_rows_is_refused_and_the_servers_go_on(llama_layouts, reference_models, llm):
    with pytest.raises(RequestError, match=r"head 'bad_rows' \(llmrl_test_plugins:BadRowsHead\) output\['bad'\] "
                                           r"has shape \(\d, 1\).*level 'candidate'") as caught:
        llama_layouts.custom_module_fns(["bad_rows"], PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm)
    assert caught.value.plugin == "llmrl_test_plugins:BadRowsHead"
    model, tok = reference_models["llama"]
    assert_scores(llama_layouts.score(CONTEXTS[:3], CANDIDATES[:3], llm=llm),
                  reference_scores(model, tok, CONTEXTS[:3], CANDIDATES[:3]))
