"""Passes with gradients read log-probs and entropies from the last hidden states, a chunk of rows at a time
(engine/model/scoring/vocab_chunks.py): outputs and gradients equal those of the full logits (1e-6, float32), on
every scoring path (packed, unpacked with a context cache, seq2seq; 1e-6 relative, as the chunks' products add in
another order), the chunks' logits are never all alive, and the
models it cannot serve exactly keep their logits."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring import vocab_chunks
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize


def run(model, tok, kind, chunked: bool, packed: bool, budget: int = 10**6):
    contexts = ["Goal: go to the red ball", "You see a wall", "open the door and go"]
    candidates = [[" turn left", " go forward now", " pick up"], [" a", " the key to it"], [" done"]]
    plan = tokenize(tok, kind, contexts, candidates, max_length=None, prefix_reuse=True, add_eos=False,
                    vocab_size=model.config.get_text_config().vocab_size)
    needs = Needs(per_token=True, entropy=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    start = model.config.decoder_start_token_id if kind == "seq2seq" else None
    module = ModelWithHeads(model, {}, kind, pad, start)
    module.update_pass = chunked
    out = module(plan, plan_batches(plan, budget, 64, needs, packed=packed), needs)
    loss = (out.token_logprobs * torch.linspace(0.5, 1.5, len(out.token_logprobs))).sum() + out.token_entropy.sum()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("kind,packed,budget", [("llama", True, 10**6), ("llama", False, 24), ("gpt2", True, 10**6),
                                                ("t5", False, 10**6)])
def test_outputs_and_gradients_equal_those_of_the_full_logits(reference_models, monkeypatch, kind, packed, budget):
    model, tok = reference_models[kind]
    model = copy.deepcopy(model).float().requires_grad_(True)
    seq2seq = "seq2seq" if kind == "t5" else "causal"
    assert vocab_chunks.applies(model, token_logits=False)
    monkeypatch.setattr(vocab_chunks, "LOGITS_PER_CHUNK", 3 * model.config.vocab_size)  # several chunks
    want, want_grads = run(model, tok, seq2seq, False, packed, budget)
    got, got_grads = run(model, tok, seq2seq, True, packed, budget)
    assert len(got.token_logprobs) > 6
    # The chunks' matrix products add in another order than the whole one: a few units in the last place.
    torch.testing.assert_close(got.token_logprobs, want.token_logprobs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.token_entropy, want.token_entropy, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.candidate_scores, want.candidate_scores, atol=1e-6, rtol=1e-6)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 4
    for key, want_g in want_grads.items():  # to 3e-6 of the largest entry: sums over rows, in another order
        scale = float(want_g.abs().max())
        assert float((got_grads[key] - want_g).abs().max()) <= 3e-6 * max(scale, 1.0), key
    assert vocab_chunks.active_output_layer() is None and "forward" not in vars(vocab_chunks.output_layer(model))


def test_only_one_chunk_of_logits_is_alive_at_a_time(reference_models, monkeypatch):
    model, _ = reference_models["llama"]
    model = copy.deepcopy(model).float().requires_grad_(True)
    vocab = model.config.vocab_size
    monkeypatch.setattr(vocab_chunks, "LOGITS_PER_CHUNK", 4 * vocab)
    monkeypatch.setattr(vocab_chunks, "KEEP_FOR_BACKWARD", 40 * vocab * 4 - 1)  # just too large to keep
    layer = vocab_chunks.output_layer(model)
    widest = []
    saved = []

    def pack(t):
        if t.data_ptr() not in (hidden.data_ptr(), layer.weight.data_ptr()):  # the inputs themselves are kept
            saved.append(t.numel())
        return t

    hidden = torch.randn(40, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (40,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = vocab_chunks.scored_logprobs_from_hidden(layer, hidden, targets, True)
    (logp.sum() + entropy.sum()).backward(inputs=[hidden])
    widest.append(max(saved))
    assert widest[0] < 40 * vocab / 2, "no tensor of all the rows' logits is kept for the backward pass"
    full = hidden.detach() @ layer.weight.detach().T
    norm = torch.logsumexp(full, -1)
    torch.testing.assert_close(logp.detach(), full[torch.arange(40), targets] - norm, atol=1e-6, rtol=0)


def test_models_whose_logits_are_not_the_plain_output_layer_keep_their_logits(reference_models):
    model, _ = reference_models["llama"]
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    assert not vocab_chunks.applies(capped, token_logits=False)
    assert not vocab_chunks.applies(model, token_logits=True), "a head reading the logits gets them"


def _counting_output_products(monkeypatch) -> list:
    """Counts the calls of ``torch.nn.functional.linear`` (the chunks' output-layer products) from now on."""
    calls, linear = [], torch.nn.functional.linear

    def counted(*args, **kwargs):
        calls.append(1)
        return linear(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    return calls


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("use_entropy", [False, True])
def test_gradients_of_hidden_weight_and_bias_equal_plain_autograd(monkeypatch, use_entropy, keep):
    """Several targets per row, a trainable output layer with a bias, the entropy in the loss or only reported; the
    chunks' logits computed again in the backward pass, or kept from the forward pass (and then not computed)."""
    torch.manual_seed(0)
    vocab, width, n = 50, 16, 9
    monkeypatch.setattr(vocab_chunks, "LOGITS_PER_CHUNK", 4 * vocab)  # chunks of 4 rows
    monkeypatch.setattr(vocab_chunks, "KEEP_FOR_BACKWARD", n * vocab * 8 if keep else n * vocab * 8 - 1)
    layer = torch.nn.Linear(width, vocab).double()
    hidden = torch.randn(n, width, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 0, 2, 3, 3, 3, 5, 8, 8, 6])
    targets = torch.randint(0, vocab, (len(index),))
    weights = torch.linspace(0.5, 1.5, len(index), dtype=torch.float64)

    def loss_of(logp, entropy):
        return (logp * weights).sum() + (entropy * torch.arange(n) / n).sum() if use_entropy else (logp * weights).sum()

    logp, entropy = vocab_chunks.scored_logprobs_from_hidden(layer, hidden, targets, True, index)
    products = _counting_output_products(monkeypatch)
    loss_of(logp, entropy).backward()
    monkeypatch.undo()
    assert len(products) == (0 if keep else 3)  # 9 rows in chunks of 4
    got = [hidden.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
    hidden.grad, layer.weight.grad, layer.bias.grad = None, None, None
    full = torch.log_softmax(layer(hidden), -1)  # the plain reference
    want_logp, want_entropy = full[index, targets], -(full.exp() * full).sum(-1)
    torch.testing.assert_close(logp, want_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-12, rtol=1e-12)
    loss_of(want_logp, want_entropy).backward()
    for g, want in zip(got, [hidden.grad, layer.weight.grad, layer.bias.grad]):
        torch.testing.assert_close(g, want, atol=1e-12, rtol=1e-10)


def test_kept_logits_serve_one_backward_pass_and_a_second_one_computes_them_again(monkeypatch):
    """The kept logits are overwritten by the first backward pass: a second one (retain_graph) must not read them."""
    torch.manual_seed(1)
    vocab, width, n = 40, 8, 7
    monkeypatch.setattr(vocab_chunks, "LOGITS_PER_CHUNK", 3 * vocab)
    layer = torch.nn.Linear(width, vocab).double()
    hidden = torch.randn(n, width, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    logp, entropy = vocab_chunks.scored_logprobs_from_hidden(layer, hidden, targets, True)
    loss = logp.sum() + 0.5 * entropy.sum()
    loss.backward(retain_graph=True, inputs=[hidden])
    first = hidden.grad.clone()
    products = _counting_output_products(monkeypatch)
    loss.backward(inputs=[hidden])
    assert len(products) == 3  # computed again: 7 rows in chunks of 3
    torch.testing.assert_close(hidden.grad, 2 * first, atol=1e-12, rtol=1e-12)
