"""Twin contexts (the same token ids and the same candidates) are computed once per pass, in-process, against plain
Hugging Face: a request whose contexts repeat, in any order, gets for every copy exactly what plain HF gives for
that context alone (scores, per-token log-probs, entropies and ids, hidden states), and a loss that weighs the
copies differently has plain autograd's gradient (the copies' gradients add up). Contexts equal as text but with
other candidates are not twins."""

from __future__ import annotations

import pytest
import torch
from test_scoring import assert_hidden_at_last_tokens
from test_token_level import assert_per_token, kind_of, text_tokens

from llmrl.engine.model.forward import distinct_contexts
from llmrl.engine.model.hf_startup import decoder_start_id
from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize

CONTEXTS = ["You see a red ball 2 steps forward.", "You see a wall.", "Goal: go to the red ball. Action:"]
CANDIDATES = [[" go forward", " turn left", " turn right"], [" turn left", " turn around"], [" go", " pick up"]]
# Copies in any order, a context equal in text to another but with other candidates (not a twin), and the
# same context again at the end.
ORDER = [0, 1, 0, 2, 1, 1, 0, 2]
OTHER = (1, [" turn left"])  # context 1's text with another candidate list


def request():
    contexts = [CONTEXTS[i] for i in ORDER] + [CONTEXTS[OTHER[0]]]
    candidates = [CANDIDATES[i] for i in ORDER] + [OTHER[1]]
    return contexts, candidates


def forward(model, tok, name, contexts, candidates, needs, budget=8192, rows=64, packed=False):
    """The engine's pass as :func:`llmrl.engine.model.forward.plan_forward` plans it: the distinct contexts are
    batched and run, the module hands their outputs to every copy."""
    kind = kind_of(name)
    plan = tokenize(tok, kind, contexts, candidates, max_length=512, vocab_size=model.config.vocab_size)
    computed, source = distinct_contexts(plan)
    batches = plan_batches(computed or plan, budget, rows, needs, packed=packed and kind == "causal")
    module = ModelWithHeads(model, {}, kind, tok.pad_token_id, decoder_start_id(model))
    return module(computed or plan, batches, needs, source=source), computed, source


def test_twins_are_found_by_ids_and_candidates(reference_models):
    model, tok = reference_models["llama"]
    contexts, candidates = request()
    plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
    computed, source = distinct_contexts(plan)
    assert source == [0, 1, 0, 2, 1, 1, 0, 2, 3]  # the last context has context 1's text, not its candidates
    assert len(computed.contexts) == 4
    assert distinct_contexts(tokenize(tok, "causal", CONTEXTS, CANDIDATES, max_length=512)) == (None, None)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("budget,rows,packed", [(8192, 64, False), (40, 3, False), (8192, 64, True)],
                         ids=["one-batch", "tight", "packed"])
def test_every_copy_gets_plain_hf_outputs(reference_models, name, budget, rows, packed):
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    contexts, candidates = request()
    needs = Needs(per_token=True, entropy=True, context_hidden=True, candidate_hidden=not seq2seq)
    with torch.no_grad():
        out, computed, _ = forward(model, tok, name, contexts, candidates, needs, budget, rows, packed)
    assert out.num_contexts == len(contexts) and len(computed.contexts) == 4
    assert out.candidate_context.tolist() == [i for i, c in enumerate(candidates) for _ in c]
    expected = [text_tokens(tok, context, cand, seq2seq) for context, cands in zip(contexts, candidates)
                for cand in cands]
    assert_per_token(out, expected, model, seq2seq)  # per candidate: tokens, log-probs, entropies, score
    assert out.candidate_token_counts.tolist() == [len(tokens) for _, tokens in expected]
    if not seq2seq:  # every copy's hidden states: plain HF's at the last token of the context, of context + candidate
        starts = [0]
        for cands in candidates:
            starts.append(starts[-1] + len(cands))
        cand_hidden = {(i, j): out.candidate_hidden[starts[i] + j]
                       for i, c in enumerate(candidates) for j in range(len(c))}
        assert_hidden_at_last_tokens(model, tok, contexts, candidates, out.context_hidden, cand_hidden)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_twins_without_candidates_get_their_context_hidden_state(reference_models, name):
    """``custom_module_fns`` without candidates (a value head reads each context's hidden state): copies of a
    context get the hidden state plain HF gives it."""
    model, tok = reference_models[name]
    contexts = [CONTEXTS[i] for i in ORDER]
    with torch.no_grad():
        out, computed, _ = forward(model, tok, name, contexts, [[] for _ in contexts], Needs(context_hidden=True))
        assert len(computed.contexts) == 3 and len(out.candidate_scores) == 0
        for i, context in enumerate(contexts):
            if kind_of(name) == "causal":
                ids = torch.tensor([tok(context)["input_ids"]])
                want = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            else:
                start = torch.tensor([[decoder_start_id(model)]])
                want = model(**tok(context, return_tensors="pt"), decoder_input_ids=start,
                             output_hidden_states=True).decoder_hidden_states[-1][0, 0]
            torch.testing.assert_close(out.context_hidden[i], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_copies_weighed_differently_get_plain_autograd_gradients(reference_models, packed):
    model, tok = reference_models["llama"]
    contexts, candidates = request()
    weight = model.model.layers[0].mlp.up_proj.weight
    out, _, _ = forward(model, tok, "llama", contexts, candidates, Needs(per_token=True, entropy=True),
                        packed=packed)
    coef = torch.linspace(-1.0, 2.0, len(out.candidate_scores))
    tcoef = torch.linspace(0.5, -0.5, len(out.token_logprobs))
    loss = (coef * out.candidate_scores).sum() + (tcoef * out.token_logprobs).sum() + 0.1 * out.token_entropy.sum()
    (got,) = torch.autograd.grad(loss, weight)
    total, k, t = 0.0, 0, 0
    for context, cands in zip(contexts, candidates):
        for cand in cands:
            conditioned, tokens = text_tokens(tok, context, cand, False)
            logits = model(input_ids=torch.tensor([conditioned + tokens])).logits[0, len(conditioned) - 1:-1]
            logp = torch.log_softmax(logits, -1)
            chosen = logp[torch.arange(len(tokens)), tokens]
            n = len(tokens)
            total = total + coef[k] * chosen.sum() + (tcoef[t:t + n] * chosen).sum() - 0.1 * (logp.exp() * logp).sum()
            k, t = k + 1, t + n
    (want,) = torch.autograd.grad(total, weight)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
