"""Live runs (every rank a process) of several model families in one run: Llama (eager attention, an ordinary
token as its pad token), GPT-2 (2 replicas), T5, a tokenizer that appends EOS and a seq2seq model whose decoder
start token is only in its generation config. Each LLM answers its own requests like plain Hugging Face (scores,
options, tokenize, model kwargs, beam search, heads reading layers); one LLM closes while the others serve."""

from __future__ import annotations

import pytest
import torch

from testkit import LiveRun, reference_scores
from testkit.serving import (
    CANDIDATES,
    CONTEXTS,
    PROBE_HEADS,
    assert_scores,
    check_generation,
    check_probe_heads,
    reference_logprobs,
    without_empty,
)

pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("llm", ["llama", "gpt2", "t5"])
def test_heads_read_layers_on_every_family(mixed_llms, reference_models, llm):
    check_probe_heads(mixed_llms, llm, reference_models[llm][0], seq2seq=llm == "t5")


def test_close_one_llm_while_the_others_serve(mixed_llms, reference_models, tmp_path):
    """Runs last in this module: close_llm stops t5-genstart's rank (it exits, and the run still ends with code 0,
    see the fixture), calls naming it raise LLMClosedError, and the other LLMs go on answering like plain HF."""
    import contextlib

    import psutil

    from llmrl import LLMClosedError

    (closed_rank,) = [r for r, s in mixed_llms.servers().items() if s["llm"] == "t5-genstart"]
    pid = mixed_llms.servers()[closed_rank]["pid"]
    assert mixed_llms.close_llm("t5-genstart") is None
    assert mixed_llms.close_llm("t5-genstart") is None  # closing twice does nothing
    with contextlib.suppress(psutil.NoSuchProcess):  # wait until it has exited and been reaped (no zombie)
        gone, alive = psutil.wait_procs([psutil.Process(pid)], timeout=300)  # a hang guard, not a speed check
        assert alive == [], f"the closed rank (pid {pid}) did not exit"
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
