"""Scored-token counts from the tokenisation alone (``TokenPlan.scored_counts``, behind
``Trainer.scored_token_counts``) equal what a forward pass counts, and the number of tokens plain Hugging Face
scores for each candidate: texts and token ids, shared and unshared prefixes, EOS added, a budget that splits the
pass, causal and seq2seq. Updaters given old log-probs skip their gradient-free pass on these counts, so a count
off by one would misalign every per-token input silently."""

from __future__ import annotations

import pytest
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
