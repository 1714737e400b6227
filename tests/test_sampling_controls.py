"""Sampling controls of ``generate``: stop strings give Hugging Face's own texts (``generate(stop_strings=...)``),
stop token ids end a sequence on them, each sample says why it ended, ``sampling_logprobs`` are the log-probs of
the distribution actually sampled from (after temperature, top-k and top-p), and ``prompt_logprobs`` are a plain
forward's."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from llmrl.engine.model.generation import generate as run_generation
from llmrl.engine.model.generation import plan_generate
from llmrl.engine.model.stops import parse_stop

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "pick up the key and", "x"]


def generate(model, tok, prompts, kwargs, seed=None):
    plan = plan_generate(model, tok, "causal", prompts, kwargs, 8192, 64, 512)
    return run_generation(model, tok, "causal", plan, "cpu", seed=seed)


def hf_generate(model, tok, prompt, seed=None, **kwargs):
    """Plain Hugging Face generate on one prompt: the generated ids and their text."""
    enc = tok(prompt, return_tensors="pt")
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, pad_token_id=tok.pad_token_id, **kwargs)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    return ids, tok.decode(ids, skip_special_tokens=True)


def stop_strings_in(model, tok, prompt) -> list[str]:
    """Two strings that greedy decoding of ``prompt`` produces mid-way (the tiny model's text is arbitrary)."""
    ids, _ = hf_generate(model, tok, prompt, max_new_tokens=16, do_sample=False)
    return [tok.decode(ids[5:7]).strip()[:3] or tok.decode(ids[5:7]), tok.decode(ids[9:10])]


@pytest.mark.parametrize("sampling", [False, True])
def test_stop_strings_give_hugging_faces_texts(reference_models, sampling):
    model, tok = reference_models["llama"]
    options = {"max_new_tokens": 16, "do_sample": sampling, **({"top_k": 20, "temperature": 0.9} if sampling else {})}
    stopped = 0
    for k, prompt in enumerate(PROMPTS):
        stops = [s for s in stop_strings_in(model, tok, prompt) if s.strip()]
        (sample,) = generate(model, tok, [prompt], {**options, "stop": stops}, seed=k)[0]
        ids, text = hf_generate(model, tok, prompt, seed=k, stop_strings=stops, tokenizer=tok, **options)
        assert sample["text"] == text, (prompt, stops)
        assert sample["tokens"].tolist() == ids[:len(sample["tokens"])]
        if sample["stop"] is not None:
            stopped += 1
            assert sample["stop_reason"] == "stop" and sample["stop"] in stops
            assert sample["stop"] in tok.decode(sample["tokens"])  # the stop text stays in the returned tokens
    assert stopped >= 2  # the stops were reached, not only the length limit


def test_hugging_faces_own_stop_strings_argument_needs_no_tokenizer(reference_models):
    """``generate(contexts, stop_strings=[...])``, as trlX's and Hugging Face's users write it: plain Hugging Face
    needs ``tokenizer=`` with it (and fails without); llmrl has the tokenizer, and gives Hugging Face's texts."""
    model, tok = reference_models["llama"]
    options = {"max_new_tokens": 16, "do_sample": False}
    stopped = 0
    for prompt in PROMPTS:
        stops = [s for s in stop_strings_in(model, tok, prompt) if s.strip()]
        with pytest.raises(ValueError, match="tokenizer"):
            hf_generate(model, tok, prompt, stop_strings=stops, **options)
        (sample,) = generate(model, tok, [prompt], {**options, "stop_strings": stops})[0]
        ids, text = hf_generate(model, tok, prompt, stop_strings=stops, tokenizer=tok, **options)
        assert sample["text"] == text and sample["tokens"].tolist() == ids, (prompt, stops)
        stopped += sample["stop"] is not None
    assert stopped >= 2
    (one,) = generate(model, tok, PROMPTS[:1], {**options, "stop_strings": "a"})[0]  # a single string
    _, text = hf_generate(model, tok, PROMPTS[0], stop_strings="a", tokenizer=tok, **options)
    assert one["text"] == text


def test_stop_token_ids_end_the_sequence_on_them_and_length_is_reported(reference_models):
    model, tok = reference_models["llama"]
    (free,) = generate(model, tok, PROMPTS[:1], {"max_new_tokens": 10, "do_sample": False})[0]
    tokens = free["tokens"].tolist()
    assert free["stop_reason"] == ("stop" if len(tokens) < 10 else "length") and free["stop"] is None
    (one,) = generate(model, tok, PROMPTS[:1], {"max_new_tokens": 10, "do_sample": False, "stop": tokens[3]})[0]
    assert one["tokens"].tolist() == tokens[:tokens.index(tokens[3]) + 1]
    assert one["stop_reason"] == "stop" and one["stop"] == tokens[3]
    pair = tokens[4:6]
    (two,) = generate(model, tok, PROMPTS[:1], {"max_new_tokens": 10, "do_sample": False, "stop": [pair]})[0]
    assert two["tokens"].tolist()[-2:] == pair and two["stop"] == pair
    torch.testing.assert_close(two["logprobs"], free["logprobs"][:len(two["tokens"])])


def test_sampling_logprobs_are_those_of_the_warped_distribution_and_logprobs_stay_raw(reference_models):
    model, tok = reference_models["llama"]
    options = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.7, "top_k": 12, "top_p": 0.8}
    results = generate(model, tok, PROMPTS, {**options, "num_return_sequences": 2}, seed=3)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(12), TopPLogitsWarper(0.8)]
    differs = 0
    for prompt, samples in zip(PROMPTS, results):
        ids = tok(prompt)["input_ids"]
        for sample in samples:
            tokens = sample["tokens"].tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
            raw = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
            warped = logits.clone()
            for warper in warpers:
                warped = warper(None, warped)
            sampled = torch.log_softmax(warped, -1)[torch.arange(len(tokens)), tokens]
            torch.testing.assert_close(sample["logprobs"], raw, atol=1e-4, rtol=0)
            torch.testing.assert_close(sample["sampling_logprobs"], sampled, atol=1e-4, rtol=0)
            assert bool(torch.isfinite(sample["sampling_logprobs"]).all())  # the chosen token is always kept
            differs += int(not torch.allclose(raw, sampled, atol=1e-3))
    assert differs > 0


def test_prompt_logprobs_equal_a_plain_forward(reference_models):
    model, tok = reference_models["llama"]
    results = generate(model, tok, PROMPTS, {"max_new_tokens": 3, "do_sample": False, "prompt_logprobs": True})
    for prompt, (sample,) in zip(PROMPTS, results):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
        want = logp[torch.arange(len(ids) - 1), ids[1:]]
        torch.testing.assert_close(sample["prompt_logprobs"], want, atol=1e-5, rtol=0)


def test_bad_stop_arguments_are_refused_naming_the_entry(reference_models):
    assert parse_stop("\n") == (["\n"], [])
    assert parse_stop([5, 6]) == ([], [[5, 6]])
    assert parse_stop(["a", 7, [8, 9]]) == (["a"], [[7], [8, 9]])
    with pytest.raises(ValueError, match=r"stop\[1\] is an empty string"):
        parse_stop(["a", ""])
    with pytest.raises(ValueError, match=r"stop\[0\] must be a string, a token id"):
        parse_stop([1.5])
    model, tok = reference_models["llama"]
    with pytest.raises(ValueError, match="not to beam search"):
        plan_generate(model, tok, "causal", PROMPTS, {"num_beams": 2, "stop": "a"}, 8192, 64, 512)


def test_stop_token_ids_never_match_across_the_prompt():
    from llmrl.engine.model.stops import StopTokens

    stop = StopTokens([[7, 8]], start=3)
    prompt_ends_with_7 = torch.tensor([[1, 2, 7, 8], [1, 2, 7, 5]])  # one generated token each
    assert stop(prompt_ends_with_7, None).tolist() == [False, False]
    assert stop(torch.tensor([[1, 2, 7, 7, 8], [1, 2, 3, 8, 7]]), None).tolist() == [True, False]
