"""The decode step written out for Llama-shaped models (``generation.llama_step``, engine/model/decoding/llama_step.py)
against Hugging Face's own step (``llama_step: false``) and a plain forward: the same tokens (greedy and seeded
samples), log-probs within float32 rounding, for Llama, Mistral, Qwen2 and Qwen3 layers, with a LoRA adapter unmerged,
merged and packed, and the cache kept across calls equal to Hugging Face's. Models it does not take decode through
Hugging Face's step."""

from __future__ import annotations

import copy

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding import loop
from llmrl.engine.model.decoding.llama_step import LlamaStep
from llmrl.engine.model.decoding.options import DecodeOptions
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from testkit.decoding import plain_logprobs

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]
GREEDY = {"max_new_tokens": 10, "do_sample": False}
SAMPLED = {"max_new_tokens": 10, "do_sample": True, "num_return_sequences": 3, "temperature": 0.9, "top_k": 0}


def family(name: str, vocab: int, **extra):
    """A small random model of one layer family: grouped heads, 3 layers, float32, SDPA attention."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[name]
    torch.manual_seed(0)
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, **{"attn_implementation": "sdpa", **extra})
    model = model_cls(config).eval()
    with torch.no_grad():  # norm weights start at one: make them count
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.normal_(1.0, 0.3)
    if name == "qwen2":  # its query/key/value biases start at zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def decode(model, tok, kwargs, seed=3, **settings):
    decoder = Decoder(GenerationSettings(**settings), "cpu")
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=seed, decoder=decoder), decoder.stats()


def assert_same(ours, reference, atol=1e-5) -> None:
    for group_a, group_b in zip(ours, reference, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a["tokens"].tolist() == b["tokens"].tolist()
            for key in ("logprobs", "sampling_logprobs"):
                torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0)


VARIANTS = {  # family, config fields
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),  # with query/key/value biases
    "llama-biased-llama3-rope-head-dim": ("llama", {  # biases everywhere, another head size, scaled rotary angles
        "attention_bias": True, "mlp_bias": True, "head_dim": 24,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-window-off": ("qwen2", {"sliding_window": 4, "use_sliding_window": False}),  # no layer slides
    "qwen3": ("qwen3", {}),  # each query and key head normalised (random norm weights)
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_layer_family_decodes_as_hugging_faces_step(reference_models, variant):
    tok = reference_models["llama"][1]
    name, extra = VARIANTS[variant]
    model = family(name, len(tok), **extra)
    if extra.get("mlp_bias"):
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if module_name.endswith("bias"):
                    param.normal_(0, 0.5)
    with torch.no_grad():  # Hugging Face then leaves output-capturing hooks on the layers (inert in the step)
        assert len(model(input_ids=torch.tensor([[1, 5, 6]]), output_hidden_states=True).hidden_states) == 4
    assert any(layer._forward_hooks for layer in model.model.layers)
    for kwargs in (GREEDY, SAMPLED):  # seeded samples drawn by torch.multinomial: equal only if the logits agree
        ours, stats = decode(model, tok, kwargs, llama_step=True)
        reference, hf_stats = decode(model, tok, kwargs, llama_step=False)
        assert stats["llama_step_batches"] == 1 and hf_stats["llama_step_batches"] == 0
        assert_same(ours, reference)
    for prompt, group in zip(PROMPTS, ours):
        for sample in group:
            expected = plain_logprobs(model, tok, prompt, sample["tokens"].tolist())
            torch.testing.assert_close(sample["logprobs"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("settings", [{}, {"merge_adapter": True}, {"merge_adapter": True, "pack_weights": False}],
                         ids=["unmerged-packed", "merged-packed", "merged"])
def test_an_adapter_unmerged_merged_or_packed_decodes_as_hugging_faces_step(reference_models, settings):
    from peft import LoraConfig, get_peft_model

    base, tok = reference_models["llama"]
    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                           init_lora_weights=False)).eval()
    ours, stats = decode(model, tok, SAMPLED, llama_step=True, **settings)
    reference, _ = decode(model, tok, SAMPLED, llama_step=False, **settings)
    assert stats["llama_step_batches"] == 1
    assert (stats["weights_packed"] > 0) == settings.get("pack_weights", True)
    assert_same(ours, reference)
    unmerged, _ = decode(model, tok, SAMPLED, llama_step=False, pack_weights=False)
    assert_same(ours, unmerged, atol=3e-5)  # (W + BA)x rounds differently from Wx + B(Ax)


def test_models_it_does_not_take_decode_through_hugging_faces_step(reference_models):
    tok = reference_models["llama"][1]
    gpt2 = reference_models["gpt2"][0]
    assert "a model of class GPT2LMHeadModel" in LlamaStep.why_not(gpt2, 64)
    assert decode(gpt2, reference_models["gpt2"][1], GREEDY, llama_step=True)[1]["llama_step_batches"] == 0

    eager = family("llama", len(tok), attn_implementation="eager")
    assert "attention implementation 'eager'" in LlamaStep.why_not(eager, 64)

    sliding = family("mistral", len(tok), sliding_window=4)
    assert "sliding attention window" in LlamaStep.why_not(sliding, 64)
    ours, stats = decode(sliding, tok, GREEDY, llama_step=True)
    assert stats["llama_step_batches"] == 0
    assert_same(ours, decode(sliding, tok, GREEDY, llama_step=False)[0])

    for window_fields in ({"use_sliding_window": False}, {"layer_types": ["full_attention"] * 3}):
        ignored = family("mistral", len(tok), sliding_window=4, **window_fields)  # Mistral slides whatever they say
        assert "sliding attention window" in LlamaStep.why_not(ignored, 64)

    training = family("llama", len(tok)).train()
    assert "training mode" in LlamaStep.why_not(training, 64)

    class Subclassed(type(training.model.layers[0].mlp)):
        pass

    subclassed = family("llama", len(tok))
    subclassed.model.layers[2].mlp.__class__ = Subclassed
    assert "replaced by other classes" in LlamaStep.why_not(subclassed, 64)

    patched = family("llama", len(tok))
    patched.model.layers[0].self_attn.forward = lambda *args, **kwargs: None
    assert "a forward replaced on LlamaAttention" in LlamaStep.why_not(patched, 64)

    hooked = family("llama", len(tok))
    calls = []
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: calls.append(1))
    assert "a forward hook on LlamaMLP" in LlamaStep.why_not(hooked, 64)
    ours, stats = decode(hooked, tok, GREEDY, llama_step=True)
    assert stats["llama_step_batches"] == 0 and len(calls) == 10  # the prefill and 9 steps, each ran the hook
    plain = family("llama", len(tok))
    assert_same(ours, decode(plain, tok, GREEDY, llama_step=True)[0])


def test_code_patched_into_transformers_or_a_module_left_training_sends_the_step_to_hugging_face(
        reference_models, monkeypatch):
    """Attention-patching libraries replace a class's ``forward``, the rotation helper or the ``sdpa`` function;
    Hugging Face's step then runs their code, so the written-out step must not run: the tokens are the patched
    model's."""
    import functools

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    tok = reference_models["llama"][1]
    model = family("llama", len(tok))
    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: 2 * original(self, x))
    assert "LlamaMLP.forward patched" in LlamaStep.why_not(model, 64)
    ours, stats = decode(model, tok, GREEDY, llama_step=True)
    reference, _ = decode(model, tok, GREEDY, llama_step=False)
    assert stats["llama_step_batches"] == 0
    assert_same(ours, reference)
    monkeypatch.undo()
    assert ours[0][0]["tokens"].tolist() != decode(model, tok, GREEDY, llama_step=True)[0][0][0]["tokens"].tolist()

    @functools.wraps(original)  # a wrapper that copies the wrapped forward's name, module and __wrapped__
    def wrapped(self, x):
        return 2 * original(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", wrapped)
    assert "LlamaMLP.forward patched" in LlamaStep.why_not(model, 64)
    monkeypatch.undo()

    class Fused(torch.nn.Module):  # a whole class swapped into the modeling module (as fused-kernel libraries do)
        forward = original

    monkeypatch.setattr(modeling_llama, "LlamaMLP", Fused)
    for layer in model.model.layers:
        layer.mlp.__class__ = Fused
    assert f"Fused (a class of {__name__}) patched" in LlamaStep.why_not(model, 64)
    monkeypatch.undo()
    for layer in model.model.layers:
        layer.mlp.__class__ = modeling_llama.LlamaMLP

    rotation = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda *args, **kwargs: rotation(*args, **kwargs))
    assert "apply_rotary_pos_emb patched" in LlamaStep.why_not(model, 64)
    monkeypatch.undo()

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", lambda *args, **kwargs: sdpa(*args, **kwargs))
    assert "'sdpa' attention function patched" in LlamaStep.why_not(model, 64)
    monkeypatch.undo()
    assert LlamaStep.why_not(model, 64) is None

    model.model.layers[1].self_attn.train()  # the model itself in eval mode: Hugging Face drops attention out
    assert LlamaStep.why_not(model, 64) is None  # (at attention_dropout 0, training mode changes nothing)
    model.config.attention_dropout = 0.1
    assert "attention dropout in a layer left in training mode" in LlamaStep.why_not(model, 64)
    model.eval()
    qwen3 = family("qwen3", len(tok))
    qwen3.model.layers[0].self_attn.q_norm.__class__ = type("OtherNorm", (torch.nn.Module,), {})
    assert "replaced by other classes" in LlamaStep.why_not(qwen3, 64)


def test_the_cache_kept_across_calls_is_hugging_faces(reference_models):
    tok = reference_models["llama"][1]
    model = family("llama", len(tok))
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), tok.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    kept = []
    for llama_step in (True, False):
        torch.manual_seed(0)
        kept.append(loop.decode(model, ids, mask, DecodeOptions(
            cache_name="cache", generate_kwargs={"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": True},
            pad_id=tok.pad_token_id, eos={2}, num_return=2, keep_cache=True, llama_step=llama_step)))
    ours, theirs = kept
    assert ours.llama_step and not theirs.llama_step
    assert torch.equal(ours.tokens, theirs.tokens)
    assert ours.cache.get_seq_length() == theirs.cache.get_seq_length() == width + 5  # the last token is not fed
    for mine, reference in zip(ours.cache.layers, theirs.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, reference.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.values, reference.values, atol=1e-5, rtol=0)


def test_processors_given_the_raw_logits_work_out_of_place_and_one_that_writes_them_is_refused():
    """The loop hands the raw logits themselves (no copy) to processors it knows to work out of place; each is
    checked here against the installed transformers, and a write is caught by the logits' version counter."""
    from transformers.generation import logits_process as lp

    made = [lp.MinLengthLogitsProcessor(20, 2), lp.MinNewTokensLengthLogitsProcessor(3, 20, 2),
            lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(5), lp.TopPLogitsWarper(0.9),
            lp.MinPLogitsWarper(0.1)]
    assert {type(p) for p in made} == loop._out_of_place()
    ids = torch.ones((4, 6), dtype=torch.long)
    for processor in made:
        logits = torch.randn(4, 50)
        before, version = logits.clone(), logits._version
        out = loop._processed(lp.LogitsProcessorList([processor]), ids, logits, copy=False)
        assert logits._version == version and torch.equal(logits, before), type(processor).__name__
        assert not torch.equal(out, before), type(processor).__name__  # it did process them

    def in_place(input_ids, scores):
        scores[:, 0] = -float("inf")
        return scores

    logits = torch.randn(4, 50)
    with pytest.raises(RuntimeError, match="wrote the raw logits in place"):
        loop._processed(lp.LogitsProcessorList([in_place]), ids, logits, copy=False)
    kept = logits.clone()
    loop._processed(lp.LogitsProcessorList([in_place]), ids, logits, copy=True)  # others get a copy
    assert torch.equal(logits, kept)


def test_bfloat16_steps_follow_hugging_faces_within_its_rounding(reference_models):
    """In bfloat16 the norms run as Hugging Face's steps (float32 inside, the weight product in bfloat16)."""
    tok = reference_models["llama"][1]
    model = family("llama", len(tok)).to(torch.bfloat16)
    ours, stats = decode(model, tok, GREEDY, llama_step=True)
    reference, _ = decode(model, tok, GREEDY, llama_step=False)
    assert stats["llama_step_batches"] == 1
    for group_a, group_b in zip(ours, reference):
        a, b = group_a[0], group_b[0]
        same = next((i for i, (x, y) in enumerate(zip(a["tokens"].tolist(), b["tokens"].tolist())) if x != y),
                    len(a["tokens"]))
        assert same >= 3  # greedy paths may part where two tokens tie within bfloat16's rounding
        torch.testing.assert_close(a["logprobs"][:same], b["logprobs"][:same], atol=0.05, rtol=0)


def test_activation_checkpointing_leaves_the_step_in_use(reference_models):
    """Checkpointing wraps the trained layers' forward; without gradients the wrapper is the layer's own forward."""
    from peft import LoraConfig, get_peft_model

    from llmrl.engine.model.training.checkpointing import enable_checkpointing

    tok = reference_models["llama"][1]
    model = get_peft_model(family("llama", len(tok)), LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                               init_lora_weights=False)).eval()
    reference, _ = decode(model, tok, SAMPLED, llama_step=False)
    assert enable_checkpointing(model) == 3
    ours, stats = decode(model, tok, SAMPLED, llama_step=True)
    assert stats["llama_step_batches"] == 1
    assert_same(ours, reference)
    assert enable_checkpointing(model) == 3  # wrapped again: still the layers' own forward
    assert LlamaStep.why_not(model.get_base_model(), 64) is None


def test_checkpointing_a_layer_whose_forward_was_replaced_keeps_the_step_away(reference_models):
    from llmrl.engine.model.training.checkpointing import enable_checkpointing

    tok = reference_models["llama"][1]
    model = family("llama", len(tok))
    for p in model.model.layers[2].parameters():
        p.requires_grad_(True)
    for layer in model.model.layers[:2]:
        layer.requires_grad_(False)
    model.model.layers[2].forward = model.model.layers[2].forward  # someone else's forward (the same, here)
    assert enable_checkpointing(model) == 1
    assert "a forward replaced on LlamaDecoderLayer" in LlamaStep.why_not(model, 64)
