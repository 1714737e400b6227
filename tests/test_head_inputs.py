"""What heads see, in-process, against plain Hugging Face ``output_hidden_states`` and logits on Llama, GPT-2 and T5:
hidden states of chosen layers at each context's and candidate's last token, per-token hidden states and float32
logits at the position that predicts each scored token, per-call keyword arguments, dict outputs and token-level
heads; a head's declarations cost no extra model call; bad declarations and bad outputs are refused with an error
naming the plugin and the attribute. (The live counterparts, 1 and 2 replicas and tensor-parallel 2, are in
test_serving_live.py.)"""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.errors import PluginError
from llmrl.engine.model.hf_startup import decoder_start_id, num_hidden_states
from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize
from llmrl.engine.model.served import needs_of
from llmrl.plugins.checks import check_contract, check_head_layers
from llmrl.plugins.contracts import Head

ID_CONTEXTS = [[17, 230, 41, 99, 5], [300], [64, 64, 64, 64, 64, 64, 64, 64, 12], [3, 150, 151]]
ID_CANDIDATES = [[[7, 8, 9, 10], [7, 8], [311], []], [[1, 2, 3, 4, 5, 6]], [[200, 201], [200, 202, 203]],
                 [[4], [19, 280, 33, 33, 33]]]
TEXT_CONTEXTS = ["You see a wa", "Possible actions: tu", "Goal: go to the red ball"]
TEXT_CANDIDATES = [["ll 2 steps forward", "lk", " red ball"], ["rn right", "rn left", "n"], [" now", "!"]]
LAYERS = (0, 1, -1)


class Probe(Head):
    """Reads everything a head can read; returns a dict, per scored token."""

    level = "token"
    needs_context_hidden = True
    needs_candidate_hidden = True
    needs_token_hidden = True
    needs_logits = True
    hidden_layers = LAYERS

    def forward(self, outputs, **kwargs):
        self.seen = outputs, kwargs
        return {"first": outputs.token_hidden[:, :2] * kwargs.get("scale", 1.0), "logprob": outputs.token_logprobs}


class Named(Head):
    """A candidate-level head with one named keyword argument (it receives only that one)."""

    level = "candidate"
    needs_context_hidden = False

    def forward(self, outputs, bias=0.0):
        return outputs.candidate_scores[:, None] + bias


def kind_of(name):
    return "seq2seq" if name.startswith("t5") else "causal"


def run(model, tok, name, contexts, candidates, heads, keys, *, reuse=True, budget=8192, rows=64, head_kwargs=None):
    kind = kind_of(name)
    plan = tokenize(tok, kind, contexts, candidates, max_length=512, prefix_reuse=reuse,
                    vocab_size=model.config.vocab_size)
    needs = needs_of([type(heads[k]) for k in keys])
    batches = plan_batches(plan, budget, rows, needs, encoder_reuse=reuse)
    module = ModelWithHeads(model, heads, kind, tok.pad_token_id, decoder_start_id(model))
    with torch.no_grad():
        return module(plan, batches, needs, keys, head_kwargs=head_kwargs)


def plain(model, name, context: list[int], tokens: list[int]):
    """One unpadded forward with output_hidden_states: per layer, (context's last token, candidate's last token,
    positions predicting each token) hidden states, and the logits at those positions."""
    if kind_of(name) == "seq2seq":
        dec = [decoder_start_id(model)] + tokens
        out = model(input_ids=torch.tensor([context]), decoder_input_ids=torch.tensor([dec]), output_hidden_states=True)
        hs, ctx_pos, cand_pos, tok_pos = out.decoder_hidden_states, 0, len(tokens), list(range(len(tokens)))
    else:
        out = model(input_ids=torch.tensor([context + tokens]), output_hidden_states=True)
        n = len(context)
        hs, ctx_pos, cand_pos = out.hidden_states, n - 1, n + len(tokens) - 1
        tok_pos = list(range(n - 1, n - 1 + len(tokens)))
    layers = {layer: (hs[layer][0, ctx_pos], hs[layer][0, cand_pos], hs[layer][0, tok_pos]) for layer in LAYERS}
    return layers, out.logits[0, tok_pos].float()


def text_tokens(tok, context, candidate, seq2seq):
    ctx = tok(context)["input_ids"]
    if seq2seq:
        return ctx, tok(candidate)["input_ids"]
    full = tok(context + candidate)["input_ids"]
    p = next((k for k, (a, b) in enumerate(zip(ctx, full)) if a != b), min(len(ctx), len(full)))
    return full[:p], full[p:]


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("reuse,budget,rows", [(True, 8192, 64), (False, 8192, 64), (True, 40, 3)],
                         ids=["reuse", "noreuse", "reuse-tight"])
def test_layers_token_hidden_and_logits_equal_plain_hf(reference_models, name, reuse, budget, rows):
    """Token ids: every declared layer at the context's / candidate's last token and at each scored token's
    predicting position, and the logits there, equal one unpadded Hugging Face forward with output_hidden_states."""
    model, tok = reference_models[name]
    probe = Probe(None)
    out = run(model, tok, name, ID_CONTEXTS, ID_CANDIDATES, {"p": probe}, ("p",), reuse=reuse, budget=budget,
              rows=rows, head_kwargs={"scale": 2.0})
    seen, kwargs = probe.seen
    assert kwargs == {"scale": 2.0} and set(seen.context_hidden_layers) == set(LAYERS)
    n_layers = len(model(input_ids=torch.tensor([[1]]), decoder_input_ids=torch.tensor([[0]]),
                         output_hidden_states=True).decoder_hidden_states if name == "t5"
                   else model(input_ids=torch.tensor([[1]]), output_hidden_states=True).hidden_states)
    assert num_hidden_states(model, kind_of(name)) == n_layers
    k = 0
    with torch.no_grad():
        for i, (context, cands) in enumerate(zip(ID_CONTEXTS, ID_CANDIDATES)):
            for cand in cands:
                layers, logits = plain(model, name, context, cand)
                rows_of = (seen.token_candidate == k).nonzero().squeeze(1)
                assert seen.token_ids[rows_of].tolist() == cand
                for layer, (ctx_h, cand_h, tok_h) in layers.items():
                    close(seen.context_hidden_layers[layer][i], ctx_h)
                    close(seen.candidate_hidden_layers[layer][k], cand_h)
                    close(seen.token_hidden_layers[layer][rows_of], tok_h)
                close(seen.token_logits[rows_of], logits)
                close(torch.log_softmax(seen.token_logits[rows_of], -1)[torch.arange(len(cand)), cand],
                      seen.token_logprobs[rows_of])
                k += 1
    assert torch.equal(seen.context_hidden, seen.context_hidden_layers[-1])
    assert torch.equal(seen.token_hidden, seen.token_hidden_layers[-1])
    assert seen.token_logits.dtype == torch.float32
    # The dict output, one row per scored token, scaled by the call's keyword argument.
    assert out.head_levels == {"p": "token"}
    torch.testing.assert_close(out.heads["p"]["first"], 2.0 * seen.token_hidden[:, :2])


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_token_hidden_of_text_with_boundary_merges(reference_models, name):
    """Text candidates whose first tokens merge with the context's end: positions follow context + candidate."""
    model, tok = reference_models[name]
    seq2seq = kind_of(name) == "seq2seq"
    probe = Probe(None)
    run(model, tok, name, TEXT_CONTEXTS, TEXT_CANDIDATES, {"p": probe}, ("p",), budget=48, rows=3)
    seen, _ = probe.seen
    k = 0
    with torch.no_grad():
        for i, (context, cands) in enumerate(zip(TEXT_CONTEXTS, TEXT_CANDIDATES)):
            alone = tok(context)["input_ids"]
            ctx_layers, _ = plain(model, name, alone, [])
            close(seen.context_hidden_layers[1][i], ctx_layers[1][0])
            for cand in cands:
                cond, tokens = text_tokens(tok, context, cand, seq2seq)
                layers, logits = plain(model, name, cond, tokens)
                rows_of = (seen.token_candidate == k).nonzero().squeeze(1)
                assert seen.token_ids[rows_of].tolist() == tokens
                for layer in LAYERS:
                    close(seen.token_hidden_layers[layer][rows_of], layers[layer][2])
                close(seen.token_logits[rows_of], logits)
                k += 1


def test_heads_get_the_keyword_arguments_they_accept_and_ask_nothing_more(reference_models):
    model, tok = reference_models["llama"]
    heads = {"p": Probe(None), "named": Named(None)}
    out = run(model, tok, "llama", ID_CONTEXTS, ID_CANDIDATES, heads, ("named", "p"),
              head_kwargs={"bias": 10.0, "scale": 3.0})
    torch.testing.assert_close(out.heads["named"], out.candidate_scores[:, None] + 10.0)
    assert heads["p"].seen[1] == {"bias": 10.0, "scale": 3.0}
    # Declarations only add what is asked; the default path keeps nothing and makes the same model calls.
    assert needs_of([]) == Needs() and needs_of([Named]) == Needs()
    needs = needs_of([Probe])
    assert needs.per_token and needs.token_hidden and needs.token_logits and needs.layers == (-1, 0, 1)
    plan = tokenize(tok, "causal", ID_CONTEXTS, ID_CANDIDATES, max_length=512, vocab_size=model.config.vocab_size)
    calls = [sum(b.model_calls for b in plan_batches(plan, 40, 3, n)) for n in
             (Needs(), Needs(per_token=True, token_hidden=True, token_logits=True, layers=(-1, 0, 1)))]
    assert calls[0] == calls[1]
    plain_out = run(model, tok, "llama", ID_CONTEXTS, ID_CANDIDATES, heads, ("named",))
    assert plain_out.token_logprobs is None and plain_out.context_hidden_layers is None
    assert plain_out.token_hidden is None and plain_out.token_logits is None
    # An argument no head of the call reads (misspelt, or for a head not called) is refused, not dropped.
    with pytest.raises(ValueError, match=r"head_kwargs \['bais'\] are read by none of the heads \['named'\]"):
        run(model, tok, "llama", ID_CONTEXTS, ID_CANDIDATES, heads, ("named",), head_kwargs={"bais": 1.0})
    with pytest.raises(ValueError, match=r"head_kwargs \['bias'\] are read by none of the heads \[\]"):
        run(model, tok, "llama", ID_CONTEXTS, ID_CANDIDATES, heads, (), head_kwargs={"bias": 1.0})


class WrongRows(Head):
    level = "candidate"

    def forward(self, outputs):
        return {"ok": outputs.candidate_scores[:, None], "bad": outputs.context_hidden}


def test_a_dict_output_with_a_wrong_first_dimension_names_the_head_and_the_entry(reference_models):
    model, tok = reference_models["gpt2"]
    module_heads = {"w": WrongRows(None)}
    with pytest.raises(PluginError, match=r"head 'w' \(WrongRows\) output\['bad'\] has shape \(4, 64\).*level "
                                          r"'candidate'.*9 row"):
        run(model, tok, "gpt2", ID_CONTEXTS, ID_CANDIDATES, module_heads, ("w",))


@pytest.mark.parametrize("attrs,words", [
    ({"level": "sequence"}, ["'my.heads:Bad'", "level = 'sequence'", "context, candidate, token"]),
    ({"hidden_layers": (-1, "2")}, ["'my.heads:Bad'", "hidden_layers", "tuple of ints"]),
    ({"hidden_layers": ()}, ["hidden_layers", "non-empty"]),
    ({"needs_logits": "yes"}, ["needs_logits = 'yes'", "True or False"]),
    ({"needs_context_logits": 1}, ["needs_context_logits = 1", "True or False"]),
])
def test_bad_declarations_are_refused_naming_the_plugin_and_the_attribute(attrs, words):
    bad = type("Bad", (Head,), {**attrs, "forward": lambda self, outputs: outputs.context_hidden})
    problem = check_contract("head", bad, "my.heads:Bad")
    assert problem is not None and all(w in problem for w in words), problem


def test_layers_beyond_the_model_are_refused():
    deep = type("Deep", (Head,), {"hidden_layers": (0, 3, -5), "forward": lambda self, outputs: None})
    assert check_head_layers(deep, "x:Deep", 4) is not None and "(-5,)" in check_head_layers(deep, "x:Deep", 4)
    assert "hidden_layers (3, -5)" in check_head_layers(deep, "x:Deep", 3)
    assert check_head_layers(deep, "x:Deep", 5) is None
