"""The logits after the context (``Head.needs_context_logits``) and the built-in ``next_token`` head, in-process,
against plain Hugging Face on Llama, GPT-2 and T5: ``model(ids).logits[0, -1]`` for a causal model (the context
tokenised alone), the decoder's first logits for T5; with and without candidates in the call, with and without
prefix reuse; log-probs over the whole vocabulary and the top k with their ids. A model type whose logits are not
its output layer applied to the last hidden state is refused by name. (The live counterpart is in
test_trlx_port_live.py.)"""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.hf_startup import decoder_start_id
from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring.context_logits import context_logits_problem
from llmrl.engine.model.scoring.planning import plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize
from llmrl.engine.model.served import needs_of
from llmrl.plugins.checks import check_contract
from llmrl.plugins.next_token import NextTokenHead

ID_CONTEXTS = [[17, 230, 41, 99, 5], [300], [64, 64, 64, 64, 64, 64, 64, 64, 12], [3, 150, 151]]
TEXT_CONTEXTS = ["You see a wa", "Possible actions: tu", "Goal: go to the red ball", "x"]


def run(model, tok, name, contexts, candidates, heads, reuse=True):
    kind = "seq2seq" if name == "t5" else "causal"
    plan = tokenize(tok, kind, contexts, candidates, max_length=512, prefix_reuse=reuse,
                    vocab_size=model.config.vocab_size)
    keys = tuple(heads)
    needs = needs_of([type(h) for h in heads.values()])
    batches = plan_batches(plan, 8192, 64, needs, encoder_reuse=reuse)
    module = ModelWithHeads(model, heads, kind, tok.pad_token_id, decoder_start_id(model))
    with torch.no_grad():
        return module(plan, batches, needs, keys)


def plain_next_logits(model, tok, name, context) -> torch.Tensor:
    """One unpadded Hugging Face forward: the logits of the token after ``context`` (text or ids)."""
    ids = tok(context)["input_ids"] if isinstance(context, str) else context
    with torch.no_grad():
        if name == "t5":
            return model(input_ids=torch.tensor([ids]),
                         decoder_input_ids=torch.tensor([[decoder_start_id(model)]])).logits[0, -1].float()
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "noreuse"])
@pytest.mark.parametrize("with_candidates", [False, True], ids=["alone", "with-candidates"])
@pytest.mark.parametrize("text", [False, True], ids=["ids", "text"])
def test_next_token_logits_equal_plain_hf(reference_models, name, reuse, with_candidates, text):
    model, tok = reference_models[name]
    contexts = TEXT_CONTEXTS if text else ID_CONTEXTS
    candidates = None
    if with_candidates:  # a boundary merge ("wa" + "ll") must not move the context's own last token
        candidates = [["ll", " red"], ["rn left"], [" now"], ["!"]] if text else [[[7, 8]], [[1, 2, 3]], [[5]], [[4]]]
    heads = {"logits": NextTokenHead(None, values="logits"), "top": NextTokenHead(None, top_k=5),
             "all": NextTokenHead(None)}
    out = run(model, tok, name, contexts, candidates, heads, reuse=reuse)
    assert out.head_levels == {"logits": "context", "top": "context", "all": "context"}
    assert out.context_logits.dtype == torch.float32 and out.context_logits.shape[0] == len(contexts)
    for i, context in enumerate(contexts):
        want = plain_next_logits(model, tok, name, context)
        torch.testing.assert_close(out.heads["logits"][i], want, atol=1e-4, rtol=0)
        logp = torch.log_softmax(want, -1)
        torch.testing.assert_close(out.heads["all"][i], logp, atol=1e-4, rtol=0)
        values, ids = logp.topk(5)
        assert out.heads["top"]["ids"][i].tolist() == ids.tolist()
        torch.testing.assert_close(out.heads["top"]["values"][i], values, atol=1e-4, rtol=0)


def test_the_head_keeps_its_contract_and_only_plain_output_models_are_served(reference_models):
    assert check_contract("head", NextTokenHead, "next_token") is None
    for name in ("llama", "gpt2", "t5"):
        assert context_logits_problem(reference_models[name][0]) is None

    class Config:
        model_type = "gemma2"
        final_logit_softcapping = 30.0

    class SoftCapped(torch.nn.Module):
        config = Config()

    assert "not 'gemma2'" in context_logits_problem(SoftCapped())
    assert "needs_logits" in context_logits_problem(SoftCapped())
