"""The batches of ``generate``: llmrl's loop bounds a batch's prefill, rows and key/value cache (not rows x length),
and a prompt whose own samples exceed the bounds runs them in runs of rows, with the same greedy results and
reproducible samples, on Hugging Face's path too."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from testkit.decoding import plain_logprobs, same_samples

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]
SETTINGS = {"default": {}, "static": {"merge_adapter": True, "static_cache": True, "length_bucket": 16}}


@pytest.fixture(scope="module")
def lora_llama(reference_models):
    """The tiny Llama with a LoRA adapter whose B is not zero (so that it changes the outputs)."""
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model), tok


def run(model, tok, kwargs, decoder):
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", decoder=decoder)


def test_the_loop_batches_by_prefill_rows_and_cache_not_by_rows_times_length():
    from llmrl.engine.model.decoding.batches import cache_bytes_per_token, decode_batches

    # a GRPO group on a GPU: 8 prompts of 64 tokens x 8 samples x 512 new tokens. Hugging Face's bound (rows x
    # (prompt + new) within 8192 tokens) ran it as 8 batches of 8 rows; the loop's prefill is 8 x 64 tokens.
    assert decode_batches([64] * 8, 512, 8, 8192, 64, 10**6) == [(list(range(8)), 8)]
    assert len(decode_batches([64] * 8, 512, 8, 8192, 64, 64 * 576 // 2)) == 2  # the cache bound
    assert len(decode_batches([64] * 8, 512, 8, 8192, 32, 10**6)) == 2  # the rows bound
    assert len(decode_batches([64] * 8, 512, 8, 256, 64, 10**6)) == 2  # the prefill bound
    assert decode_batches([3, 900, 5], 4, 2, 100, 64, 10**6) == [([1], 2), ([2, 0], 2)]  # longest first; alone if
    # too long

    class Config:  # SmolLM2-135M: 30 layers, 3 key/value heads of 64
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 30, 9, 3, 576

    assert cache_bytes_per_token(Config(), 4) == 2 * 30 * 3 * 64 * 4


def test_small_cache_budgets_split_the_request_and_change_nothing(lora_llama):
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 8, "do_sample": True, "num_return_sequences": 2}
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    whole = Decoder(GenerationSettings(), "cpu")
    split = Decoder(GenerationSettings(cache_mb=0.001), "cpu")  # a batch per sample
    assert whole.batches(model, plan, 8192, 64) == [([1, 0, 2, 3], 2)]
    assert split.batches(model, plan, 8192, 64) == [([i], 1) for i in (1, 1, 0, 0, 2, 2, 3, 3)]
    greedy = {"max_new_tokens": 8, "do_sample": False}
    assert same_samples(run(model, tok, greedy, whole), run(model, tok, greedy, split))


def test_one_prompts_samples_beyond_the_bounds_are_cut_into_runs_of_its_rows():
    from llmrl.engine.model.decoding.batches import decode_batches
    from llmrl.engine.model.generation import plan_generation

    assert decode_batches([10], 4, 128, 8192, 64, 10**6) == [([0], 64), ([0], 64)]  # the rows bound
    assert decode_batches([10], 4, 130, 8192, 64, 10**6) == [([0], 44), ([0], 43), ([0], 43)]  # near-equal runs
    assert decode_batches([10], 4, 16, 8192, 64, 100) == [([0], 6), ([0], 5), ([0], 5)]  # the cache: 7 rows of 14
    assert decode_batches([10, 9], 4, 40, 8192, 64, 10**6) == [([0], 40), ([1], 40)]  # prompts apart, not cut
    assert decode_batches([10], 4, 3, 8192, 64, 1) == [([0], 1)] * 3  # one row at least
    # Hugging Face's path: rows x (prompt + new tokens) within the token budget
    assert plan_generation([10], 4, 128, 8192, 64) == [([0], 64), ([0], 64)]
    assert plan_generation([10, 20], 4, 8, 100, 64) == [([1], 4), ([1], 4), ([0], 4), ([0], 4)]  # 4 x 24, 7 x 14


@pytest.mark.parametrize("name", ["hf", "default", "static"])
def test_a_prompts_samples_cut_into_runs_give_the_same_greedy_samples_and_reproduce_when_sampled(lora_llama, name):
    model, tok = lora_llama
    decoder = None if name == "hf" else Decoder(GenerationSettings(**SETTINGS[name]), "cpu")

    def call(kwargs, max_rows, seed=None):
        plan = plan_generate(model, tok, "causal", PROMPTS[:2], kwargs, 8192, max_rows, 512)
        return plan, generate(model, tok, "causal", plan, "cpu", seed=seed, decoder=decoder)

    greedy = {"max_new_tokens": 6, "do_sample": True, "top_k": 1, "num_return_sequences": 5}  # (greedy: 1 row)
    plan, cut = call(greedy, max_rows=2)
    assert [rows for _, rows in plan.batches] == [2, 2, 1, 2, 2, 1]  # each prompt's 5 rows in runs of 2, 2, 1
    _, whole = call(greedy, max_rows=64)
    assert [len(r) for r in cut] == [5, 5] and same_samples(cut, whole)
    for a, b in zip(cut, whole):
        for x, y in zip(a, b):
            torch.testing.assert_close(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)
    sampled = {"max_new_tokens": 6, "do_sample": True, "num_return_sequences": 5}
    _, first = call(sampled, max_rows=2, seed=3)
    _, again = call(sampled, max_rows=2, seed=3)
    assert [len(r) for r in first] == [5, 5] and same_samples(first, again)
    for prompt, samples in zip(PROMPTS[:2], first):
        for sample in samples[-3:]:  # the later runs' samples: their log-probs are the model's
            if len(sample["tokens"]):
                torch.testing.assert_close(sample["logprobs"], plain_logprobs(model, tok, prompt,
                                                                              sample["tokens"].tolist()),
                                           atol=1e-5, rtol=0)
