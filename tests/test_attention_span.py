"""Packed scoring rows and the cache across calls only for models whose every layer attends over the whole context
(``engine/model/attention_span.py``). For each kind of model refused (a sliding window, chunked attention, layers
that are not attention, ALiBi), tiny random models show why: llmrl's packed rows score otherwise than plain Hugging
Face scoring each candidate alone, while its unpacked rows score the same; ``packs`` now sends them unpacked, and
the cache across calls refuses them; a model with layers that are not attention also encodes each context with
each candidate (its cache cannot repeat a context's rows: Hugging Face raised there). Models it accepts score
packed as plain Hugging Face does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from llmrl.engine.model.attention_span import why_not_whole_context
from llmrl.engine.model.forward import packs, shares_contexts
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
from llmrl.engine.model.scoring.tokenization import tokenize

SMALL = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
WINDOWED = {"num_key_value_heads": 2, "intermediate_size": 32, "sliding_window": 4}
MODELS = {  # name: (config class, model class, fields, the refusal's words or None)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, "intermediate_size": 32}, None),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 16, "n_layer": 2, "n_head": 4, "vocab_size": 100}, None),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {**SMALL, **WINDOWED}, "sliding window"),
    "starcoder2-window": ("Starcoder2Config", "Starcoder2ForCausalLM", {**SMALL, **WINDOWED}, "sliding window"),
    "gemma2-window": ("Gemma2Config", "Gemma2ForCausalLM", {**SMALL, **WINDOWED, "head_dim": 4}, "sliding window"),
    "lfm2-conv-layers": ("Lfm2Config", "Lfm2ForCausalLM", {
        **SMALL, "num_key_value_heads": 2, "intermediate_size": 32, "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3, "pad_token_id": 0}, "not attention"),
    "mpt-alibi": ("MptConfig", "MptForCausalLM", {"d_model": 16, "n_layers": 2, "n_heads": 4, "vocab_size": 100,
                                                  "max_seq_len": 64}, "ALiBi"),
}


def sums(model, contexts, candidates, packed: bool, reuse: bool = True) -> list[torch.Tensor]:
    plan = tokenize(None, "causal", contexts, candidates, max_length=512, prefix_reuse=reuse)
    scores = [None] * len(contexts)
    for batch in plan_batches(plan, 8192, 64, Needs(), packed=packed, encoder_reuse=reuse):
        assert batch.packed == packed
        result = run_batch(model, plan, batch, Needs(), 0, "cpu", accepts_logits_to_keep(model))
        offset = 0
        for i in batch.contexts:
            count = len(plan.contexts[i].candidates)
            scores[i], offset = result.scores[offset:offset + count], offset + count
    return scores


def plain(model, contexts, candidates) -> list[torch.Tensor]:
    """Each candidate scored alone: one plain forward over context + candidate."""
    out = []
    for context, group in zip(contexts, candidates):
        row = []
        for candidate in group:
            logp = model(input_ids=torch.tensor([context + candidate])).logits[0].float().log_softmax(-1)
            row.append(sum(logp[len(context) - 1 + t, token] for t, token in enumerate(candidate)))
        out.append(torch.stack(row))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_rows_only_where_every_layer_attends_over_the_whole_context(name):
    config_class, model_class, fields, refusal = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    served = SimpleNamespace(llm=SimpleNamespace(type="causal", prefix_reuse=True, lockstep=False), model=model)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()  # noqa: E731
    contexts, candidates = [ids(12), ids(3), ids(6)], [[ids(2), ids(4), ids(1)], [ids(3), ids(5)], [ids(4), ids(2)]]
    with torch.no_grad():
        expected = plain(model, contexts, candidates)
        packed = sums(model, contexts, candidates, packed=True)
        unpacked = sums(model, contexts, candidates, packed=False, reuse=shares_contexts(served))
    # (a hybrid's cache cannot repeat a context's rows: its contexts are encoded with each candidate)
    assert shares_contexts(served) == (refusal != "not attention")
    for got, want in zip(unpacked, expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    packed_error = max(float((got - want).abs().max()) for got, want in zip(packed, expected))
    reason = why_not_whole_context(model.config)
    if refusal is None:
        assert reason is None and packs(served) and packed_error < 1e-4
    else:
        assert refusal in reason and not packs(served)
        assert packed_error > 1e-2, "packing this model would have been exact: the refusal costs speed for nothing"


def test_the_cache_across_calls_refuses_what_packing_refuses_and_call_dependent_rotary_frequencies():
    from llmrl.engine.errors import ConfigError
    from llmrl.engine.model.hf_startup import make_prefix_cache

    llm = SimpleNamespace(name="main", kv_cache_mb=64, dtype="float32")
    window = transformers.MistralConfig(**SMALL, **WINDOWED)
    longrope = transformers.Phi3Config(**SMALL, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 2, "long_factor": [2.0] * 2,
        "original_max_position_embeddings": 16}, max_position_embeddings=64)
    for config, words in ((window, "sliding window"), (longrope, "longrope rotary frequencies")):
        with pytest.raises(ConfigError, match=f"kv_cache_mb.*{words}"):
            make_prefix_cache(SimpleNamespace(config=config), llm)
        assert why_not_whole_context(config, across_calls=True) is not None
    assert why_not_whole_context(longrope) is None  # within one call, every row uses the call's frequencies
    assert make_prefix_cache(SimpleNamespace(config=transformers.LlamaConfig(**SMALL)), llm) is not None


def test_a_model_with_layers_that_are_not_attention_samples_through_hugging_faces_generate(reference_models):
    """llmrl's decoding loop repeats and grows attention caches; LFM2's convolution layers' cache has neither (the
    loop raised AttributeError): such a model samples through Hugging Face's generate, seeded samples equal."""
    from llmrl.engine.config.types import GenerationSettings
    from llmrl.engine.model.decoding.runtime import Decoder
    from llmrl.engine.model.generation import generate, plan_generate

    tok = reference_models["llama"][1]
    config_class, model_class, fields, _ = MODELS["lfm2-conv-layers"]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{
        **fields, "vocab_size": len(tok)})).eval()
    kwargs = {"max_new_tokens": 5, "do_sample": True, "num_return_sequences": 2}
    samples = {}
    for decoder in ("hf", "auto"):
        plan = plan_generate(model, tok, "causal", ["hello there", "x"], kwargs, 8192, 64, 512)
        loop = Decoder(GenerationSettings(decoder=decoder), "cpu")
        results = generate(model, tok, "causal", plan, "cpu", decoder=loop, seed=4)
        samples[decoder] = [s["tokens"].tolist() for group in results for s in group]
    assert samples["auto"] == samples["hf"]
    assert loop.stats()["calls"] == {"hf: the model has layers that are not attention": 1}


CONFIGS = {  # config class, fields, the refusal's words for packing (None: packed), and for the cache across calls
    "qwen2 defaults (window set, not used)": ("Qwen2Config", {}, None, None),
    "qwen3 defaults": ("Qwen3Config", {}, None, None),
    "mistral v0.2+ (no window)": ("MistralConfig", {"sliding_window": None}, None, None),
    "phi-3.5 (a window longer than any input)": ("Phi3Config", {"sliding_window": 262144,
                                                                "max_position_embeddings": 131072}, None, None),
    "phi-3-mini-4k (window 2047)": ("Phi3Config", {"sliding_window": 2047, "max_position_embeddings": 4096},
                                    "sliding window", "sliding window"),
    "gpt-neo local layers": ("GPTNeoConfig", {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
                             "sliding window", "sliding window"),
    "llama 4 chunks": ("Llama4TextConfig", {"attention_chunk_size": 8192}, "sliding window or chunks", "chunks"),
    "jamba": ("JambaConfig", {}, "not attention", "not attention"),
    "falcon alibi": ("FalconConfig", {"alibi": True}, "ALiBi", "ALiBi"),
    "llama dynamic rope": ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, None,
                           "dynamic rotary"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_kind_of_config_is_classified(name):
    config_class, fields, packing, across_calls = CONFIGS[name]
    config = getattr(transformers, config_class)(**fields)
    for words, reason in ((packing, why_not_whole_context(config)),
                          (across_calls, why_not_whole_context(config, across_calls=True))):
        assert (reason is None) if words is None else (reason is not None and words in reason), (name, reason)
