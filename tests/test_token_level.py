"""Token level, in-process, against plain Hugging Face: contexts and candidates given as token ids are scored exactly
as given (no BOS, no EOS, no re-tokenisation); per-token log-probs and entropies equal a plain log_softmax over the
full logits of one unpadded forward, for text with boundary merges and for ids, with prefix reuse on and off and a
token budget that forces several batches and chunks, and their gradients equal plain autograd's; ``add_eos`` ends
every candidate with EOS; bad ids are refused with their index; prompts of ids generate as given."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.model.hf_startup import decoder_start_id
from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize
from llmrl.engine.requests.inputs import check_candidates, check_contexts, check_vocabulary

# Text with boundary merges ("You see a wa" + "ll ...", "actions: tu" + "rn right"), a candidate sharing its first
# tokens with another (rows are shared), an empty candidate, a one-token candidate.
TEXT_CONTEXTS = ["You see a wa", "Possible actions: tu", "Goal: go to the red ball", "café "]
TEXT_CANDIDATES = [["ll 2 steps forward", "lk", " red ball"], ["rn right", "rn left", "n"],
                   [" now", " now and then", "", "!"], ["naïve", " über"]]
# Ids: no BOS, ids that no text tokenises to (random), one-token contexts, candidates that share a start, an empty one.
ID_CONTEXTS = [[17, 230, 41, 99, 5], [300], [64, 64, 64, 64, 64, 64, 64, 64, 12], [3, 150, 151]]
ID_CANDIDATES = [[[7, 8, 9, 10], [7, 8], [311], []], [[1, 2, 3, 4, 5, 6]], [[200, 201], [200, 202, 203]],
                 [[4], [19, 280, 33, 33, 33]]]
LAYOUTS = [(True, 8192, 64), (False, 8192, 64), (True, 40, 3), (False, 40, 3)]
LAYOUT_IDS = ["reuse", "noreuse", "reuse-tight", "noreuse-tight"]


def kind_of(name: str) -> str:
    return "seq2seq" if name.startswith("t5") else "causal"


def forward(model, tok, name, contexts, candidates, *, reuse=True, budget=8192, rows=64, per_token=True,
            entropy=True, add_eos=False, chunks_at_least=1):
    """The engine's forward (tokenise, plan, run, back to request order) on the plain model."""
    kind = kind_of(name)
    plan = tokenize(tok, kind, contexts, candidates, max_length=512, prefix_reuse=reuse, add_eos=add_eos,
                    vocab_size=model.config.vocab_size)
    needs = Needs(per_token=per_token, entropy=entropy)
    batches = plan_batches(plan, budget, rows, needs, encoder_reuse=reuse)
    assert sum(len(b.chunks) for b in batches) >= chunks_at_least, "the budget must force several chunks"
    assert sum(b.model_calls for b in batches) == sum(b.model_calls for b in plan_batches(
        plan, budget, rows, Needs(), encoder_reuse=reuse)), "per-token outputs must not change the model calls"
    module = ModelWithHeads(model, {}, kind, tok.pad_token_id, decoder_start_id(model))
    return module(plan, batches, needs)


def plain(model, context_ids: list[int], tokens: list[int], seq2seq: bool):
    """Per-token log-probs and entropies of ``tokens`` after ``context_ids``: one unpadded forward, log_softmax over
    the full logits (seq2seq: the encoder reads the context, the decoder starts from the start token)."""
    if not tokens:
        return torch.zeros(0), torch.zeros(0)
    if seq2seq:
        dec = [decoder_start_id(model)] + tokens[:-1]
        logits = model(input_ids=torch.tensor([context_ids]), decoder_input_ids=torch.tensor([dec])).logits[0]
    else:
        logits = model(input_ids=torch.tensor([context_ids + tokens])).logits[0, len(context_ids) - 1:-1]
    logp = torch.log_softmax(logits.float(), -1)
    return logp[torch.arange(len(tokens)), tokens], -(logp.exp() * logp).sum(-1)


def text_tokens(tok, context: str, candidate: str, seq2seq: bool) -> tuple[list[int], list[int]]:
    """What plain Hugging Face scores for text: the candidate's tokens of tokenize(context + candidate) after its
    common prefix with tokenize(context) (seq2seq: the candidate tokenised alone)."""
    ctx = tok(context)["input_ids"]
    if seq2seq:
        return ctx, tok(candidate)["input_ids"]
    full = tok(context + candidate)["input_ids"]
    p = next((k for k, (a, b) in enumerate(zip(ctx, full)) if a != b), min(len(ctx), len(full)))
    return full[:p], full[p:]


def assert_per_token(out, expected: list[tuple[list[int], list[int]]], model, seq2seq: bool):
    """``expected``: per candidate in request order, (the ids it is conditioned on, its scored ids)."""
    logp, mask = out.tokens_by_candidate()
    entropy, _ = out.tokens_by_candidate(out.token_entropy)
    ids, _ = out.tokens_by_candidate(out.token_ids, fill=-1)
    assert logp.shape[0] == len(expected) and out.token_logprobs.shape == out.token_candidate.shape
    with torch.no_grad():
        for k, (context, tokens) in enumerate(expected):
            want_lp, want_entropy = plain(model, context, tokens, seq2seq)
            n = len(tokens)
            assert int(mask[k].sum()) == n and ids[k, :n].tolist() == tokens, k
            torch.testing.assert_close(logp[k, :n], want_lp, atol=1e-4, rtol=0)
            torch.testing.assert_close(entropy[k, :n], want_entropy, atol=1e-4, rtol=0)
            assert float(out.candidate_scores[k]) == pytest.approx(float(want_lp.sum()), abs=1e-4)
    assert int(out.candidate_token_counts.sum()) == len(out.token_logprobs)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("reuse,budget,rows", LAYOUTS, ids=LAYOUT_IDS)
def test_token_ids_are_scored_exactly_as_given(reference_models, name, reuse, budget, rows):
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    out = forward(model, tok, name, ID_CONTEXTS, ID_CANDIDATES, reuse=reuse, budget=budget, rows=rows,
                  chunks_at_least=2 if budget < 100 else 1)
    expected = [(context, cand) for context, cands in zip(ID_CONTEXTS, ID_CANDIDATES) for cand in cands]
    assert_per_token(out, expected, model, seq2seq)
    plain_only = forward(model, tok, name, ID_CONTEXTS, ID_CANDIDATES, reuse=reuse, budget=budget, rows=rows,
                         per_token=False, entropy=False)
    assert plain_only.token_logprobs is None and plain_only.token_entropy is None
    torch.testing.assert_close(plain_only.candidate_scores, out.candidate_scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "llama-eos"])
@pytest.mark.parametrize("reuse,budget,rows", LAYOUTS, ids=LAYOUT_IDS)
def test_per_token_logprobs_and_entropies_of_text_equal_plain_hf(reference_models, name, reuse, budget, rows):
    """Text contexts with boundary merges, their text candidates, and id candidates of the same text contexts
    (which follow the whole context, tokenised alone)."""
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    id_cands = [[[120], [44, 45, 46]] for _ in TEXT_CONTEXTS]
    candidates = [texts + ids for texts, ids in zip(TEXT_CANDIDATES, id_cands)]
    out = forward(model, tok, name, TEXT_CONTEXTS, candidates, reuse=reuse, budget=budget, rows=rows,
                  chunks_at_least=2 if budget < 100 else 1)
    expected = []
    merged = 0
    for context, texts, ids in zip(TEXT_CONTEXTS, TEXT_CANDIDATES, id_cands):
        for cand in texts:
            conditioned, tokens = text_tokens(tok, context, cand, seq2seq)
            merged += len(conditioned) < len(tok(context)["input_ids"])
            expected.append((conditioned, tokens))
        expected += [(tok(context)["input_ids"], cand) for cand in ids]
    assert seq2seq or merged >= 3, "the inputs must include boundary merges"
    assert_per_token(out, expected, model, seq2seq)


def test_per_token_gradients_equal_plain_autograd(reference_models):
    """A token-level loss (weights per token, an entropy bonus) through the engine's pass, prefix reuse and a tight
    budget included, has plain autograd's gradient."""
    model, tok = reference_models["llama"]
    contexts = [TEXT_CONTEXTS[0], ID_CONTEXTS[0]]
    candidates = [TEXT_CANDIDATES[0], ID_CANDIDATES[0]]
    weight = model.model.layers[0].self_attn.q_proj.weight
    out = forward(model, tok, "llama", contexts, candidates, budget=40, rows=3, chunks_at_least=2)
    coef = torch.linspace(-1.0, 2.0, len(out.token_logprobs))
    loss = (coef * out.token_logprobs).sum() + 0.1 * out.token_entropy.sum()
    (got,) = torch.autograd.grad(loss, weight)
    expected = [text_tokens(tok, contexts[0], c, False) for c in candidates[0]]
    expected += [(contexts[1], c) for c in candidates[1]]
    total, k = 0.0, 0
    for context, tokens in expected:
        if not tokens:
            continue
        logits = model(input_ids=torch.tensor([context + tokens])).logits[0, len(context) - 1:-1]
        logp = torch.log_softmax(logits, -1)
        chosen = logp[torch.arange(len(tokens)), tokens]
        total = total + (coef[k:k + len(tokens)] * chosen).sum() - 0.1 * (logp.exp() * logp).sum()
        k += len(tokens)
    (want,) = torch.autograd.grad(total, weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "llama-eos"])
def test_add_eos_ends_every_candidate_with_eos(reference_models, name):
    """Text candidates end with one EOS (the tokenizer's own when it appends one: llama-eos, T5), id candidates get
    it appended; the EOS is scored like any token."""
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    eos = tok.eos_token_id
    contexts = [TEXT_CONTEXTS[0], TEXT_CONTEXTS[2]]
    candidates = [["ll 2 steps", ""], [" now", [44, 45], [eos]]]
    out = forward(model, tok, name, contexts, candidates, add_eos=True)
    expected = []
    for context, cands in zip(contexts, candidates):
        for cand in cands:
            if isinstance(cand, str):
                conditioned, tokens = text_tokens(tok, context, cand, seq2seq)
            else:
                conditioned, tokens = tok(context)["input_ids"], list(cand)
            expected.append((conditioned, tokens if tokens[-1:] == [eos] else tokens + [eos]))
    assert_per_token(out, expected, model, seq2seq)
    ids, mask = out.tokens_by_candidate(out.token_ids, fill=-1)
    last = ids[torch.arange(len(ids)), mask.sum(1) - 1]
    assert last.tolist() == [eos] * len(expected)


def test_add_eos_without_an_eos_token_is_refused(reference_models):
    _, tok = reference_models["gpt2"]
    tok = copy.deepcopy(tok)
    tok.eos_token = None
    with pytest.raises(ValueError, match="add_eos=True, but this model's tokenizer has no EOS token"):
        tokenize(tok, "causal", ["a"], [[" b"]], max_length=None, add_eos=True)


def test_ids_outside_the_vocabulary_are_refused_with_their_index(reference_models):
    model, tok = reference_models["llama"]
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"contexts\[1\]\[2\] is {vocab}, not a token id of this model"):
        tokenize(tok, "causal", ["a", [1, 2, vocab]], None, max_length=None, vocab_size=vocab)
    with pytest.raises(ValueError, match=r"candidates\[0\]\[1\]\[0\] is 100000"):
        tokenize(tok, "causal", ["a"], [[" b", [100000]]], max_length=None, vocab_size=vocab)
    with pytest.raises(ValueError, match=r"candidates\[0\]\[0\] is a string but contexts\[0\] is a list of token ids"):
        tokenize(tok, "seq2seq", [[5, 6]], [["b"]], max_length=None, vocab_size=vocab)
    with pytest.raises(ValueError, match=r"contexts\[0\]\[0\] is 999"):
        plan_generate(model, tok, "causal", [[999]], {}, 8192, 64, 512, vocab_size=vocab)


def test_bad_ids_are_refused_on_the_client():
    assert check_contexts(["a", (1, 2), torch.tensor([3, 4])]) == ["a", [1, 2], [3, 4]]
    assert check_candidates([[torch.tensor([5]), [6, 7], []]], [[1]]) == [[[5], [6, 7], []]]
    cases = [
        (lambda: check_contexts([[1, True]]), InvalidArgumentType, r"contexts\[0\]\[1\] must be a token id \(an int\), "
                                                                    "got bool"),
        (lambda: check_contexts([[1, 2.0]]), InvalidArgumentType, r"contexts\[0\]\[1\] must be a token id"),
        (lambda: check_contexts(["a", [4, -1]]), InvalidArgument,
         r"contexts\[1\]\[1\] is -1; token ids are non-negative"),
        (lambda: check_contexts([torch.tensor([1.0])]), InvalidArgumentType, r"contexts\[0\]\[0\] must be a token id"),
        (lambda: check_contexts([torch.tensor([[1]])]), InvalidArgumentType, r"contexts\[0\] must be a string or a "
                                                                             "list of token ids; got a tensor"),
        (lambda: check_contexts([1, 2]), InvalidArgumentType, r"contexts\[0\] must be a string or a list of token ids, "
                                                              r"got int \(one context of token ids"),
        (lambda: check_contexts([[]]), InvalidArgument, r"contexts\[0\] is an empty list of token ids"),
        (lambda: check_candidates([["b"]], [[1, 2]]), InvalidArgument, r"candidates\[0\]\[0\] is a string but "
                                                                        r"contexts\[0\] is a list of token ids"),
        (lambda: check_candidates([[1, 2]], ["a"]), InvalidArgumentType, r"candidates\[0\]\[0\] must be a string or a "
                                                                         r"list of token ids, got int \(one candidate"),
        (lambda: check_candidates([[[3, None]]], ["a"]), InvalidArgumentType, r"candidates\[0\]\[0\]\[1\] must be a "
                                                                              "token id"),
        (lambda: check_vocabulary(["a", [1, 320]], None, 320, "main"), InvalidArgument,
         r"contexts\[1\]\[1\] is 320, not a token id of LLM 'main' \(0 <= id < 320\)"),
        (lambda: check_vocabulary(["a", [1]], [[" b"], [[2], [3, 4, 999]]], 320, "main"), InvalidArgument,
         r"candidates\[1\]\[1\]\[2\] is 999"),
    ]
    check_vocabulary(["a", [319]], [[" b"], [[0], []]], 320, "main")
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_prompts_of_ids_generate_as_given(reference_models, name):
    """A prompt of ids (here without the BOS the tokenizer would add) generates what plain HF generates from those
    ids, and the samples' log-probs are the plain model's."""
    model, tok = reference_models[name]
    kind = kind_of(name)
    prompts = [[17, 230, 41, 99, 5], tok("You see a wall")["input_ids"][1:], "You see a wall"]
    plan = plan_generate(model, tok, kind, prompts, {"max_new_tokens": 5, "do_sample": False}, 8192, 64, 512,
                         vocab_size=model.config.vocab_size)
    results = generate(model, tok, kind, plan, "cpu")
    for prompt, (sample,) in zip(prompts, results):
        ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        with torch.no_grad():
            want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                  pad_token_id=tok.pad_token_id)[0]
        want = (want[1:] if kind == "seq2seq" else want[len(ids):]).tolist()
        eos = model.generation_config.eos_token_id
        want = want[: want.index(eos) + 1] if eos in want else want
        assert sample["tokens"].tolist() == want
        with torch.no_grad():
            logp, _ = plain(model, ids, want, kind == "seq2seq")
        torch.testing.assert_close(sample["logprobs"], logp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_logprobs_and_entropies_read_in_pieces_equal_one_piece(reference_models, monkeypatch, name):
    """Without gradients, rows are normalised a few at a time (forced here: 2 rows' worth of logits per piece), and
    every per-token log-prob, entropy and summed score is the same as in one piece, bit for bit."""
    from llmrl.engine.model.scoring import results

    model, tok = reference_models[name]
    with torch.no_grad():
        whole = forward(model, tok, name, ID_CONTEXTS, ID_CANDIDATES)
        monkeypatch.setattr(results, "LOGITS_PER_PIECE", 2 * model.config.vocab_size)
        pieces = forward(model, tok, name, ID_CONTEXTS, ID_CANDIDATES)
    for got, want in ((pieces.candidate_scores, whole.candidate_scores), (pieces.token_logprobs, whole.token_logprobs),
                      (pieces.token_entropy, whole.token_entropy)):
        assert len(want) > 4 and torch.equal(got, want)


def test_scored_logprobs_in_pieces_by_hand():
    from llmrl.engine.model.scoring import results

    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.bfloat16)
    index, targets = torch.tensor([6, 0, 3, 3]), torch.tensor([10, 0, 5, 6])
    full = torch.log_softmax(logits.float(), -1)
    want_lp = full[index, targets]
    want_entropy = -(full.exp() * full).sum(-1)
    for per_piece in (11, 22, 77, 1 << 24):  # 1, 2, 7 rows a piece, and one piece
        results.LOGITS_PER_PIECE, saved = per_piece, results.LOGITS_PER_PIECE
        try:
            with torch.no_grad():
                lp, entropy = results.scored_logprobs(logits, targets, True, index)
        finally:
            results.LOGITS_PER_PIECE = saved
        assert lp.dtype == torch.float32 and entropy.shape == (7,)
        torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy, want_entropy, atol=1e-6, rtol=0)
