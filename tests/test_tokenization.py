"""Token plans follow plain Hugging Face: the candidate's tokens are what follows the common prefix of
tokenize(context) and tokenize(context + candidate), so merges across the boundary are kept."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from llmrl.engine.model.scoring.tokenization import common_prefix_length, tokenize


@pytest.fixture(scope="module")
def merging_tokenizer():
    """Hand-built BPE: 'a'+'b' merge into 'ab'; BOS is prepended."""
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "a": 3, "b": 4, "c": 5, "ab": 6}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2


def test_boundary_merge_is_scored_as_plain_hf_would(merging_tokenizer):
    plan = tokenize(merging_tokenizer, "causal", ["ca"], [["b", "c", ""]], max_length=None)
    ctx = plan.contexts[0]
    assert ctx.ids == [0, 5, 3]  # <s> c a
    # "cab" -> <s> c ab: the candidate's token is the merged "ab", following the prefix <s> c.
    assert ctx.shared == 2
    b, c, empty = ctx.candidates
    assert b.rest == [6] and b.first_scored == 0
    assert c.rest == [3, 5] and c.first_scored == 1  # "cac" -> <s> c a c: only "c" is scored
    assert empty.rest == [3] and empty.rest[empty.first_scored:] == []


def test_without_prefix_reuse_rows_hold_the_whole_text(merging_tokenizer):
    plan = tokenize(merging_tokenizer, "causal", ["ca"], [["b"]], max_length=None, prefix_reuse=False)
    cand = plan.contexts[0].candidates[0]
    assert plan.contexts[0].shared == 0 and cand.rest == [0, 5, 6] and cand.first_scored == 2


def test_seq2seq_targets_are_tokenised_alone(merging_tokenizer):
    plan = tokenize(merging_tokenizer, "seq2seq", ["c"], [["ab", ""]], max_length=None)
    assert [c.rest for c in plan.contexts[0].candidates] == [[0, 6], [0]]
    assert all(c.first_scored == 0 for c in plan.contexts[0].candidates)


def test_too_long_inputs_are_refused_with_their_index(merging_tokenizer):
    with pytest.raises(ValueError, match="context 1 is 4 tokens long; this model accepts at most 3"):
        tokenize(merging_tokenizer, "causal", ["c", "ccc"], [[], []], max_length=3)
    with pytest.raises(ValueError, match="context 0 with candidate 1 is 5 tokens"):
        tokenize(merging_tokenizer, "causal", ["c"], [["c", "ccc"]], max_length=4)


def test_a_candidate_with_nothing_to_condition_on_is_refused():
    vocab = {"a": 0, "b": 1, "ab": 2, "<pad>": 3}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")])),
                                  pad_token="<pad>")
    with pytest.raises(ValueError, match="candidate 0 of context 0 has no token to be conditioned on"):
        tokenize(tok, "causal", ["a"], [["b"]], max_length=None)
