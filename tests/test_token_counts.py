"""Scored-token counts from the tokenisation alone (``TokenPlan.scored_counts``, behind
``Trainer.scored_token_counts``) equal what a forward pass counts, and the number of tokens plain Hugging Face
scores for each candidate: texts and token ids, shared and unshared prefixes, EOS added, a budget that splits the
pass, causal and seq2seq. Updaters given old log-probs skip their gradient-free pass on these counts, so a count
off by one would misalign every per-token input silently."""

from __future__ import annotations

import pytest
import torch
from test_token_level import forward, kind_of, text_tokens

from llmrl.engine.model.scoring.tokenization import tokenize

# The last context ends inside a word that its candidates complete: their tokens then re-tokenise the context's
# end, which is part of what they continue but not scored (``first_scored`` > 0).
CONTEXTS = ["You see a red ball 2 steps forward.", "Goal: open the door. Action:", "A", "I like the colour re"]
CANDIDATES = [[" go forward", " turn left", " x"], [" open it", " walk away slowly now"], [" b", " c d e f"],
              ["d", "st", "ally red"]]


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("budget,add_eos", [(8192, False), (24, False), (8192, True)], ids=["one", "tight", "eos"])
def test_counts_from_the_tokenisation_equal_the_forward_pass(reference_models, name, budget, add_eos):
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    plan = tokenize(tok, kind_of(name), CONTEXTS, CANDIDATES, max_length=512, add_eos=add_eos,
                    vocab_size=model.config.vocab_size)
    out = forward(model, tok, name, CONTEXTS, CANDIDATES, budget=budget, add_eos=add_eos)
    assert plan.scored_counts() == out.candidate_token_counts.tolist()
    if not seq2seq:
        assert any(c.first_scored > 0 for c in plan.contexts[-1].candidates)
    if not add_eos:  # plain Hugging Face's own count of each candidate's tokens
        plain = [len(text_tokens(tok, c, x, seq2seq)[1]) for c, xs in zip(CONTEXTS, CANDIDATES) for x in xs]
        assert plan.scored_counts() == plain


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_counts_of_token_ids_are_their_lengths(reference_models, name):
    model, tok = reference_models[name]
    contexts = [tok(c)["input_ids"] for c in CONTEXTS]
    candidates = [[[5, 6, 7], [8]], [[9, 10]], [[11] * 6, [12, 13, 14]]]
    plan = tokenize(tok, kind_of(name), contexts, candidates, max_length=512, vocab_size=model.config.vocab_size)
    out = forward(model, tok, name, contexts, candidates, budget=24)
    assert plan.scored_counts() == out.candidate_token_counts.tolist() == [3, 1, 2, 6, 3]


def test_a_pass_without_logprobs_reads_heads_and_counts_alone(reference_models, monkeypatch):
    """``logprobs=False`` (``Needs.logprobs``): the token counts and the per-token layout are the same, the
    log-probs NaN, and no output-layer product runs over the vocabulary in an updater's pass."""
    from llmrl.engine.model.module import ModelWithHeads
    from llmrl.engine.model.scoring import vocab_chunks
    from llmrl.engine.model.scoring.planning import Needs, plan_batches

    model, tok = reference_models["llama"]
    contexts, candidates = ["Goal: go to the red ball", "x"], [[" turn left", " go"], [" a b c"]]
    plan = tokenize(tok, "causal", contexts, candidates, max_length=None, prefix_reuse=True, add_eos=False,
                    vocab_size=model.config.vocab_size)
    module = ModelWithHeads(model, {}, "causal", tok.pad_token_id, None)
    module.update_pass = True  # an updater's pass: log-probs from hidden states, a chunk of rows at a time
    products, original = [], vocab_chunks.chunked_values

    def counting(*args, **kwargs):
        products.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(vocab_chunks, "chunked_values", counting)
    outs, chunks = {}, {}
    for logprobs in (True, False):
        needs = Needs(per_token=True, logprobs=logprobs)
        before = len(products)
        with torch.no_grad():
            outs[logprobs] = module(plan, plan_batches(plan, 10**6, 64, needs), needs)
        chunks[logprobs] = len(products) - before
    assert chunks[True] > 0 and chunks[False] == 0, chunks  # no output-layer product without log-probs
    with_lp, without = outs[True], outs[False]
    assert torch.equal(with_lp.candidate_token_counts, without.candidate_token_counts)
    assert torch.equal(with_lp.token_candidate, without.token_candidate)
    assert torch.isfinite(with_lp.token_logprobs).all() and torch.isnan(without.token_logprobs).all()
