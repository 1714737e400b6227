"""The scoring pipeline (prefix reuse, token-budget batching, heads' hidden states) equals plain
Hugging Face forward passes on unpadded single sequences, for Llama, GPT-2 and T5."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.model.forward import packing
from llmrl.engine.model.hf_startup import decoder_start_id
from llmrl.engine.model.scoring.packed import attention_per_column
from llmrl.engine.model.scoring.planning import Needs, packing_pays, plan_batches
from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
from llmrl.engine.model.scoring.tokenization import tokenize
from testkit import reference_scores

# Boundary merges: "café " + "naïve", "You see a wa" + "ll ...", "actions: tu" + "rn right" tokenise into fewer
# context tokens than the context alone; "" is an empty context (BOS models condition on the BOS token).
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café ", "東京 is", "x x x", "",
            "You see a wa", "Possible actions: tu"]
CANDIDATES = [[" turn left", " turn right", " go forward", "", "Ünïcödé 🙂"],
              ["pick up", " pick up", "  drop"],
              [],
              ["naïve", " über"],
              [f" c{i}" for i in range(20)],
              [" a", "x"],
              ["ll 2 steps forward", "lk", " red ball"],
              ["rn right", "rn left", "n"]]


def run_plan(model, tok, kind, contexts, candidates, needs=None, budget=8192, rows=64, reuse=True, kv_cache=None,
             packed=False, trunk=None, attention=0.0):
    needs = needs or Needs()
    plan = tokenize(tok, kind, contexts, candidates, max_length=512, prefix_reuse=reuse)
    scores = [None] * len(contexts)
    ctx_hidden = [None] * len(contexts)
    cand_hidden = {}
    with torch.no_grad():
        cached = None if kv_cache is None else (lambda ids: kv_cache.cache.held(kv_cache.namespace, ids))
        for batch in plan_batches(plan, budget, rows, needs, encoder_reuse=reuse, packed=packed, cached=cached,
                                  attention=attention):
            res = run_batch(model, plan, batch, needs, tok.pad_token_id, "cpu",
                            kind == "causal" and accepts_logits_to_keep(model), decoder_start_id(model),
                            prefix_cache=kv_cache, trunk=trunk)
            offset = 0
            for a, i in enumerate(batch.contexts):
                k = len(plan.contexts[i].candidates)
                scores[i] = res.scores[offset:offset + k]
                if needs.context_hidden:
                    ctx_hidden[i] = res.context_hidden[-1][a]
                if needs.candidate_hidden:
                    for j in range(k):
                        cand_hidden[i, j] = res.candidate_hidden[-1][offset + j]
                offset += k
    return scores, ctx_hidden, cand_hidden


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5", "llama-eos", "t5-genstart"])
@pytest.mark.parametrize("reuse", [True, False], ids=["prefix-reuse", "no-reuse"])
@pytest.mark.parametrize("budget,rows", [(8192, 64), (48, 3)], ids=["one-batch", "tight-budget"])
@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_scores_equal_plain_hf(reference_models, kind, reuse, budget, rows, packed):
    model, tok = reference_models[kind]
    contexts, candidates = CONTEXTS, CANDIDATES
    if kind == "gpt2":  # GPT-2 adds no BOS: an empty context has nothing to condition on
        keep = [i for i, c in enumerate(CONTEXTS) if c]
        contexts, candidates = [CONTEXTS[i] for i in keep], [CANDIDATES[i] for i in keep]
    seq2seq = kind.startswith("t5")
    expected = reference_scores(model, tok, contexts, candidates, seq2seq=seq2seq)
    got, _, _ = run_plan(model, tok, "seq2seq" if seq2seq else "causal", contexts, candidates,
                         budget=budget, rows=rows, reuse=reuse, packed=packed)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def test_token_budget_bounds_every_pass(reference_models):
    model, tok = reference_models["llama"]
    plan = tokenize(tok, "causal", CONTEXTS, CANDIDATES, max_length=512)
    batches = plan_batches(plan, 64, 4, Needs())
    assert len(batches) > 1
    for batch in batches:
        prefix = max(plan.contexts[i].shared for i in batch.contexts)
        assert len(batch.contexts) == 1 or len(batch.contexts) * prefix <= 64
        for chunk in batch.chunks:
            assert len(chunk) <= 4


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_causal_hidden_states_are_taken_at_the_right_tokens(reference_models, kind, packed):
    model, tok = reference_models[kind]
    contexts, candidates = CONTEXTS[:2], CANDIDATES[:2]
    _, ctx_hidden, cand_hidden = run_plan(model, tok, "causal", contexts, candidates,
                                          Needs(context_hidden=True, candidate_hidden=True), packed=packed)
    assert_hidden_at_last_tokens(model, tok, contexts, candidates, ctx_hidden, cand_hidden)


def assert_hidden_at_last_tokens(model, tok, contexts, candidates, ctx_hidden, cand_hidden):
    """Hidden states equal plain HF's last-layer state at the last token of the context, and of context + candidate."""
    def last_hidden(text):
        ids = torch.tensor([tok(text)["input_ids"]])
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]

    with torch.no_grad():
        for i, (context, cands) in enumerate(zip(contexts, candidates)):
            torch.testing.assert_close(ctx_hidden[i], last_hidden(context), atol=1e-4, rtol=0)
            for j, cand in enumerate(cands):
                torch.testing.assert_close(cand_hidden[i, j], last_hidden(context + cand), atol=1e-4, rtol=0)


def test_seq2seq_context_hidden_is_the_decoder_start_position(reference_models):
    model, tok = reference_models["t5"]
    _, ctx_hidden, _ = run_plan(model, tok, "seq2seq", CONTEXTS[:2], CANDIDATES[:2], Needs(context_hidden=True))
    start = model.config.decoder_start_token_id
    with torch.no_grad():
        for i, context in enumerate(CONTEXTS[:2]):
            out = model(**tok(context, return_tensors="pt"), decoder_input_ids=torch.tensor([[start]]),
                        output_hidden_states=True)
            torch.testing.assert_close(ctx_hidden[i], out.decoder_hidden_states[-1][0, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_gradients_flow_through_the_cache(reference_models, packed):
    """Training uses the same pipeline: the gradient of a prefix-reuse score equals plain autograd's."""
    model, tok = reference_models["llama"]
    contexts, candidates = CONTEXTS[:2], CANDIDATES[:2]
    weight = model.model.layers[0].self_attn.q_proj.weight
    plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
    batch = plan_batches(plan, 8192, 64, Needs(), packed=packed)[0]
    assert batch.packed == packed
    res = run_batch(model, plan, batch, Needs(), tok.pad_token_id, "cpu", True)
    (grad,) = torch.autograd.grad(res.scores.sum(), weight)
    total = 0.0
    for context, cands in zip(contexts, candidates):
        for cand in cands:
            ctx_ids, full = tok(context)["input_ids"], tok(context + cand)["input_ids"]
            p = next((k for k, (a, b) in enumerate(zip(ctx_ids, full)) if a != b), min(len(ctx_ids), len(full)))
            lp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0], -1)
            total = total + sum(lp[t - 1, full[t]] for t in range(p, len(full)))
    (expected,) = torch.autograd.grad(total, weight)
    torch.testing.assert_close(grad, expected, atol=1e-4, rtol=1e-4)


SHARED_CONTEXTS = ["Goal: go to the red ball.\nYou see a red ball 1 step left.\nAction:",
                   "Goal: go to the red ball.\nYou see a wall 2 steps forward.\nAction:",
                   "Goal: go to the red ball.\nYou see nothing.\nAction:",
                   "Goal: go to the red ball.\nYou see"]
SHARED_CANDIDATES = [[" turn left", " turn right", " turn", " go forward", " go to the red ball", " go to the red box"],
                     [" turn left", " turn right", " go forward"],
                     [" turn left", " turn left", ""],
                     [" a red ball", " a red box", " a"]]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("packed,min_saving", [(False, None), (True, None), (True, 0)],
                         ids=["chunked", "packed", "packed-common-pass"])
def test_shared_prefixes_and_shared_candidate_rows(reference_models, monkeypatch, kind, packed, min_saving):
    """Contexts sharing a prefix and candidates sharing rows give plain HF's scores. Chunked, the common prefix is
    encoded once; packed, everything takes one call, after a pass over the common prefix only when that saves
    re-encoding enough tokens (forced here with a threshold of 0)."""
    from llmrl.engine.model.scoring import planning as batching
    from llmrl.engine.model.scoring.tokenization import common_prefix_length

    if min_saving is not None:
        monkeypatch.setattr(batching, "COMMON_PASS_MIN_SAVING", min_saving)
    model, tok = reference_models[kind]
    plan = tokenize(tok, "causal", SHARED_CONTEXTS, SHARED_CANDIDATES, max_length=512)
    (batch,) = plan_batches(plan, 8192, 64, Needs(), packed=packed)
    rows = sum(len(c) for c in batch.chunks)
    assert rows < sum(len(c) for c in SHARED_CANDIDATES) - 6, "rows whose inputs coincide must be shared"
    common = common_prefix_length(*[c.prefix for c in plan.contexts])
    saving = common * (len(SHARED_CONTEXTS) - 1)
    assert common > 0 and (batch.common > 0) == (not packed or saving >= batching.COMMON_PASS_MIN_SAVING)
    # common prefix, own prefixes, candidates (packed: own prefixes and candidates together)
    assert batch.model_calls == (1 + (batch.common > 0) if packed else 2 + len(batch.chunks))
    expected = reference_scores(model, tok, SHARED_CONTEXTS, SHARED_CANDIDATES)
    got, ctx_hidden, cand_hidden = run_plan(model, tok, "causal", SHARED_CONTEXTS, SHARED_CANDIDATES,
                                            Needs(context_hidden=True, candidate_hidden=True), packed=packed)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert_hidden_at_last_tokens(model, tok, SHARED_CONTEXTS, SHARED_CANDIDATES, ctx_hidden, cand_hidden)


@pytest.mark.parametrize("span", [1, 24, 10_000], ids=["a-row-each", "some-rows", "one-row"])
def test_packed_rows_of_any_span_give_plain_hf_results(reference_models, monkeypatch, span):
    """Contexts share packed rows up to a span of columns; rows are padded to the widest. However they are
    laid out, scores, per-token log-probs and hidden states equal plain HF's."""
    from llmrl.engine.model.scoring import packed as packing

    monkeypatch.setattr(packing, "ROW_SPANS", (span,))
    model, tok = reference_models["llama"]
    expected = reference_scores(model, tok, SHARED_CONTEXTS + CONTEXTS, SHARED_CANDIDATES + CANDIDATES)
    got, ctx_hidden, cand_hidden = run_plan(model, tok, "causal", SHARED_CONTEXTS + CONTEXTS,
                                            SHARED_CANDIDATES + CANDIDATES,
                                            Needs(context_hidden=True, candidate_hidden=True), packed=True)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert_hidden_at_last_tokens(model, tok, SHARED_CONTEXTS + CONTEXTS, SHARED_CANDIDATES + CANDIDATES,
                                 ctx_hidden, cand_hidden)


@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_each_prefix_scores_its_candidates_first_tokens_from_one_row(reference_models, monkeypatch, packed):
    """The first token of every candidate that starts right after a shared prefix is scored from that prefix's last
    logits: one row per prefix (its normaliser computed once), not one copy per candidate; the scores stay plain
    Hugging Face's."""
    import sys

    from llmrl.engine.model.scoring import results

    model, tok = reference_models["llama"]
    rows_scored, original = [], results.scored_logprobs

    def recording(logits, targets, entropy, index=None):
        if sys._getframe(2).f_code.co_name == "prefix_outputs":  # (through results.needed_logprobs)
            rows_scored.append((logits.shape[0], len(targets)))
        return original(logits, targets, entropy, index)

    monkeypatch.setattr(results, "scored_logprobs", recording)
    contexts = ["x x x", "Goal: go to the red ball"]
    candidates = [[f" c{i}" for i in range(6)], [" now", " then", " a"]]
    got, _, _ = run_plan(model, tok, "causal", contexts, candidates, Needs(per_token=True, entropy=True),
                         packed=packed)
    assert rows_scored == [(2, 9)], rows_scored  # two prefixes' rows for the nine first tokens
    for g, e in zip(got, reference_scores(model, tok, contexts, candidates)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def test_packing_pays_by_the_cost_model():
    """Hand-computed costs, tokens x (1 + attention x attended columns): a context of 10 tokens with two 3-token
    rows costs 16 x 1.16 = 18.56 packed, and 64 (the prefix's call) + 10 x 1.1 + 2 x 3 x 1.13 = 81.78 unpacked; a
    context of 4 tokens with four 100-token rows costs 404 x 5.04 = 2036.16 packed and 64 + 4 x 1.04 + 400 x 2.04 =
    884.16 unpacked. Without an attention cost, packing always pays."""
    assert packing_pays([10], [[3, 3]], 0.01)
    assert not packing_pays([4], [[100] * 4], 0.01)
    assert packing_pays([4], [[100] * 4], 0.0) and packing_pays([10], [[3, 3]], 0.0)
    assert not packing_pays([10, 4], [[3, 3], [100] * 4], 0.01)  # 2054.72 against 965.94: the request unpacks


def test_long_candidates_run_unpacked_with_plain_hf_scores(reference_models):
    """Continuations of 40 tokens side by side would cost the packed row more attention than sharing the prompt
    saves (the tiny Llama's attention cost per column is large): the planner runs them unpacked, with plain Hugging
    Face's scores; the demo's short actions stay packed."""
    model, tok = reference_models["llama"]
    served = SimpleNamespace(llm=SimpleNamespace(type="causal"), model=model)
    assert packing(served) == {"packed": True, "attention": attention_per_column(model.config)}  # what servers pass
    alpha = packing(served)["attention"]
    words = "the red ball is near the green box and the agent turns left then right again".split()
    contexts = ["Goal: go to the red ball.", "You see a wall."]
    candidates = [[" " + " ".join(words[k:] + words[:k]) for k in range(4)] for _ in contexts]
    long_plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
    short_plan = tokenize(tok, "causal", CONTEXTS, CANDIDATES, max_length=512)
    assert not any(b.packed for b in plan_batches(long_plan, 8192, 64, Needs(), packed=True, attention=alpha))
    assert all(b.packed for b in plan_batches(short_plan, 8192, 64, Needs(), packed=True, attention=alpha))
    assert all(b.packed for b in plan_batches(long_plan, 8192, 64, Needs(), packed=True))  # no attention cost given
    got, _, _ = run_plan(model, tok, "causal", contexts, candidates, packed=True, attention=alpha)
    for g, e in zip(got, reference_scores(model, tok, contexts, candidates)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
