"""The written-out decode step of a family added through the registry alone (Phi-3: packed ``qkv_proj`` and
``gate_up_proj``, a rotation of part of each head; engine/model/families/phi3.py) against Hugging Face's own
decoding: greedy tokens equal to ``model.generate``'s on each prompt alone, raw log-probs within 1e-5 of a plain
forward's (float32), and seeded samples and log-probs equal to those of the loop with Hugging Face's step. The tiny
models are built here from a transformers config with random weights."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.llama_step import LlamaStep
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from testkit.decoding import plain_logprobs

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]
GREEDY = {"max_new_tokens": 10, "do_sample": False}
SAMPLED = {"max_new_tokens": 10, "do_sample": True, "num_return_sequences": 3, "temperature": 0.9, "top_k": 0}


def phi3(vocab: int, **extra):
    """A small random Phi-3: grouped heads, 3 layers, float32, SDPA attention, norm weights away from one."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa", **extra)
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    return model


def decode(model, tok, kwargs, llama_step: bool):
    decoder = Decoder(GenerationSettings(llama_step=llama_step), "cpu")
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=3, decoder=decoder), decoder.stats()


VARIANTS = {
    "phi3": {},
    "phi3-partial-rotary": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}},  # as Phi-4-mini's (0.75)
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_phi3_greedy_decoding_is_hugging_faces_generate_and_forward(reference_models, variant):
    tok = reference_models["llama"][1]
    model = phi3(len(tok), **VARIANTS[variant])
    assert LlamaStep.why_not(model, 64) is None
    ours, stats = decode(model, tok, GREEDY, llama_step=True)
    assert stats["llama_step_batches"] == 1
    for prompt, group in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY, pad_token_id=2,
                                       eos_token_id=2)[0, ids.shape[1]:]
        tokens = group[0]["tokens"].tolist()
        assert tokens == reference.tolist()
        expected = plain_logprobs(model, tok, prompt, tokens)
        torch.testing.assert_close(group[0]["logprobs"], expected, atol=1e-5, rtol=0)


def test_phi3_samples_are_those_of_hugging_faces_step(reference_models):
    """Seeded samples drawn by ``torch.multinomial``: equal only where the logits agree to rounding."""
    tok = reference_models["llama"][1]
    model = phi3(len(tok))
    ours, stats = decode(model, tok, SAMPLED, llama_step=True)
    reference, hf_stats = decode(model, tok, SAMPLED, llama_step=False)
    assert stats["llama_step_batches"] == 1 and hf_stats["llama_step_batches"] == 0
    for group_a, group_b in zip(ours, reference, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a["tokens"].tolist() == b["tokens"].tolist()
            for key in ("logprobs", "sampling_logprobs"):
                torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)


def test_phi3_sliding_window_shorter_than_the_batch_keeps_hugging_faces_step(reference_models):
    tok = reference_models["llama"][1]
    model = phi3(len(tok), sliding_window=4)
    assert "sliding attention window" in LlamaStep.why_not(model, 64)
    assert decode(model, tok, GREEDY, llama_step=True)[1]["llama_step_batches"] == 0
