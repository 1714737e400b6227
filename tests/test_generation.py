"""Batched generation equals plain Hugging Face generate, and its log-probs are the raw model's (also when a logits
processor runs the model again)."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.generation import check_generate_kwargs, plan_generate
from llmrl.engine.model.generation import generate as run_generation

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]


def generate(model, tok, kind, prompts, kwargs, device, budget, rows, max_length, seed=None):
    plan = plan_generate(model, tok, kind, prompts, kwargs, budget, rows, max_length)
    return run_generation(model, tok, kind, plan, device, seed=seed)


def _reference_logprobs(model, tok, prompt, tokens, seq2seq):
    with torch.no_grad():
        if seq2seq:
            dec = [model.config.decoder_start_token_id] + tokens[:-1]
            logits = model(**tok(prompt, return_tensors="pt"), decoder_input_ids=torch.tensor([dec])).logits[0]
            return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        ids = tok(prompt)["input_ids"]
        full = torch.tensor([ids + tokens])
        logits = model(input_ids=full).logits[0]
        lp = torch.log_softmax(logits, -1)
        return torch.stack([lp[len(ids) + t - 1, tok_id] for t, tok_id in enumerate(tokens)])


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
def test_greedy_generation_matches_plain_hf(reference_models, kind):
    model, tok = reference_models[kind]
    k = "seq2seq" if kind == "t5" else "causal"
    results = generate(model, tok, k, PROMPTS, {"max_new_tokens": 6, "do_sample": False}, "cpu", 8192, 64, 512)
    for prompt, (sample,) in zip(PROMPTS, results):
        with torch.no_grad():
            enc = tok(prompt, return_tensors="pt")
            plain = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        plain = plain[0, enc["input_ids"].shape[1]:] if k == "causal" else plain[0, 1:]
        plain = plain.tolist()
        eos = model.generation_config.eos_token_id
        if eos in plain:
            plain = plain[: plain.index(eos) + 1]
        assert sample["tokens"].tolist() == plain
        expected = _reference_logprobs(model, tok, prompt, plain, k == "seq2seq")
        torch.testing.assert_close(sample["logprobs"], expected, atol=1e-4, rtol=0)


def test_sampled_logprobs_are_raw_and_stop_at_eos(reference_models):
    model, tok = reference_models["llama"]
    torch.manual_seed(0)
    greedy = generate(model, tok, "causal", PROMPTS[:1], {"max_new_tokens": 8}, "cpu", 8192, 64, 512)[0][0]
    stop = greedy["tokens"][2].item()  # make the third generated token an EOS
    out = generate(model, tok, "causal", PROMPTS[:1], {"max_new_tokens": 8, "eos_token_id": stop}, "cpu", 8192, 64,
                   512)[0][0]
    assert out["tokens"].tolist() == greedy["tokens"][:3].tolist()
    assert len(out["logprobs"]) == 3
    # Temperature and top-k change the sampling, not the reported log-probs.
    hot = generate(model, tok, "causal", PROMPTS[:2], {"max_new_tokens": 5, "do_sample": True, "temperature": 3.0,
                                                        "top_k": 5, "num_return_sequences": 3}, "cpu", 8192, 64, 512,
                   seed=1)
    assert [len(r) for r in hot] == [3, 3]
    for prompt, samples in zip(PROMPTS[:2], hot):
        for s in samples:
            expected = _reference_logprobs(model, tok, prompt, s["tokens"].tolist(), False)
            torch.testing.assert_close(s["logprobs"], expected, atol=1e-4, rtol=0)


def test_reserved_generate_arguments_are_refused():
    with pytest.raises(ValueError, match="output_logits"):
        check_generate_kwargs({"output_logits": False})


def _plain_beams(model, tok, prompt, seq2seq, **kwargs):
    """Plain HF beam search on one unpadded prompt: its sequences (cut after EOS) and sequences_scores."""
    with torch.no_grad():
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                             **kwargs)
    sequences = out.sequences[:, 1:] if seq2seq else out.sequences[:, enc["input_ids"].shape[1]:]
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    cut = [s[: s.index(eos) + 1] if eos in s else s for s in sequences.tolist()]
    return cut, out.sequences_scores


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
def test_beam_search_matches_plain_hf(reference_models, kind):
    """Beam search in left-padded batches returns plain HF's sequences and their beam scores (sequences_scores),
    and each token's log-prob under the raw model, read from the beam that produced it. The second case makes a
    frequent token the EOS, so beams end at different lengths."""
    model, tok = reference_models[kind]
    seq2seq = kind == "t5"
    k = "seq2seq" if seq2seq else "causal"
    beams = {"num_beams": 4, "num_return_sequences": 3, "max_new_tokens": 6, "do_sample": False}
    first = generate(model, tok, k, PROMPTS, beams, "cpu", 8192, 64, 512)
    counts = torch.cat([s["tokens"] for samples in first for s in samples]).bincount()
    common = int(counts.argmax())  # the most frequent generated token becomes the EOS of the second case
    for kwargs in (beams, {**beams, "eos_token_id": common}):
        results = generate(model, tok, k, PROMPTS, kwargs, "cpu", 8192, 64, 512)
        ended_early = 0
        for prompt, samples in zip(PROMPTS, results):
            plain, scores = _plain_beams(model, tok, prompt, seq2seq, **kwargs)
            assert [s["tokens"].tolist() for s in samples] == plain
            for sample, score in zip(samples, scores):
                assert sample["beam_score"] == pytest.approx(float(score), abs=1e-4)
                expected = _reference_logprobs(model, tok, prompt, sample["tokens"].tolist(), seq2seq)
                torch.testing.assert_close(sample["logprobs"], expected, atol=1e-4, rtol=0)
                ended_early += len(sample["tokens"]) < 6
        assert kwargs is beams or ended_early > 0, "no beam ended at the forced EOS: the case did not test it"
    # 3 rows a prompt with 2 allowed: the rows of one beam search are never cut into runs (each run would return
    # the search's best beams again)
    narrow = generate(model, tok, k, PROMPTS, beams, "cpu", 8192, 2, 512)
    assert [[s["tokens"].tolist() for s in r] for r in narrow] == [[s["tokens"].tolist() for s in r] for r in first]
    greedy = generate(model, tok, k, PROMPTS[:1], {"max_new_tokens": 3}, "cpu", 8192, 64, 512)[0][0]
    assert "beam_score" not in greedy


def spy_on_output_logits(model, monkeypatch) -> list:
    """Each later ``model.generate`` call appends the ``output_logits`` it was given to the returned list."""
    asked = []
    real_generate = model.generate

    def spy(*args, **kwargs):
        asked.append(kwargs.get("output_logits"))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    return asked


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_sampled_logprobs_are_read_step_by_step_and_equal_plain_hf_output_logits(reference_models, kind, monkeypatch):
    """Sampling (temperature, top-k, several sequences, a user's stopping criterion) keeps no rows x steps x
    vocabulary logits, and its log-probs equal those computed from plain Hugging Face's kept raw logits (1e-6)."""
    from transformers import StoppingCriteria

    model, tok = reference_models[kind]
    k = "seq2seq" if kind == "t5" else "causal"

    class AfterFour(StoppingCriteria):  # a user's criterion keeps working beside llmrl's
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= start + 4, dtype=torch.bool)

    prompt = PROMPTS[1]
    start = tok(prompt, return_tensors="pt")["input_ids"].shape[1] if k == "causal" else 1
    settings = {"max_new_tokens": 7, "do_sample": True, "temperature": 2.0, "top_k": 7, "num_return_sequences": 4}
    asked = spy_on_output_logits(model, monkeypatch)
    (samples,) = generate(model, tok, k, [prompt], {**settings, "stopping_criteria": [AfterFour()]}, "cpu", 8192, 64,
                          512, seed=5)
    monkeypatch.undo()
    assert asked == [False]
    torch.manual_seed(5)
    with torch.no_grad():
        enc = tok(prompt, return_tensors="pt")
        plain = model.generate(**enc, **settings, stopping_criteria=[AfterFour()], pad_token_id=tok.pad_token_id,
                               return_dict_in_generate=True, output_logits=True)
    tokens = plain.sequences[:, start:]
    logits = torch.stack(plain.logits, dim=1).float()
    expected = logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    assert tokens.shape[1] == 4
    eos = model.generation_config.eos_token_id
    for row, sample in enumerate(samples):
        ids = tokens[row].tolist()
        end = ids.index(eos) + 1 if eos in ids else len(ids)
        assert sample["tokens"].tolist() == ids[:end]
        torch.testing.assert_close(sample["logprobs"], expected[row, :end], atol=1e-6, rtol=0)


def test_beam_search_still_reads_the_kept_logits(reference_models, monkeypatch):
    model, tok = reference_models["llama"]
    asked = spy_on_output_logits(model, monkeypatch)
    generate(model, tok, "causal", PROMPTS[:1], {"max_new_tokens": 3, "num_beams": 2}, "cpu", 8192, 64, 512)
    assert asked == [True]


def test_a_stop_string_that_begins_in_the_prompt_is_named():
    """Hugging Face's stop strings match across the prompt's end (a string counts when it ends in the generated
    text); the sample's ``stop`` names that string, not None beside ``stop_reason == "stop"``."""
    from llmrl.engine.model.stops import which_stop
    from llmrl.engine.model.store.tiny_models import build_tiny

    torch.manual_seed(0)
    model, tok = build_tiny("llama")
    model.eval()
    prompt = PROMPTS[0]
    free = generate(model, tok, "causal", [prompt], {"max_new_tokens": 4}, "cpu", 8192, 64, 512)[0][0]
    first = tok.decode(free["tokens"][:1])
    stop = prompt[-2:] + first[:1]  # two characters of the prompt, then the first generated one
    assert stop not in tok.decode(free["tokens"])
    out = generate(model, tok, "causal", [prompt], {"max_new_tokens": 4, "stop": [stop]}, "cpu", 8192, 64, 512)[0][0]
    assert out["tokens"].tolist() == free["tokens"][:1].tolist() and out["stop_reason"] == "stop"
    assert out["stop"] == stop
    ids = tok(prompt)["input_ids"]  # a string wholly inside the prompt did not stop the generated text
    assert which_stop(tok, free["tokens"].tolist(), [prompt[-4:]], [], prompt=ids) is None


def test_logprobs_stay_the_policys_when_a_logits_processor_runs_the_model_again(reference_models):
    """Classifier-free guidance (like NLPO's steering) calls the model a second time inside each step; the returned
    ``logprobs`` are still the policy's own, not that second call's."""
    model, tok = reference_models["llama"]
    prompt = PROMPTS[1]
    out = generate(model, tok, "causal", [prompt], {"max_new_tokens": 6, "do_sample": False, "guidance_scale": 1.5},
                   "cpu", 8192, 64, 512)[0][0]
    expected = _reference_logprobs(model, tok, prompt, out["tokens"].tolist(), False)
    torch.testing.assert_close(out["logprobs"], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loop", [False, True])
def test_min_new_tokens_holds_back_the_tokenizers_eos_where_the_model_names_none(reference_models, loop):
    """With no EOS in the model's generation config, samples end at the tokenizer's EOS; min_new_tokens must hold that
    EOS back as generate(eos_token_id=tokenizer's) does (the samples ended on it after 2 of at least 6 tokens)."""
    import copy

    from llmrl.engine.config.types import GenerationSettings
    from llmrl.engine.model.decoding.runtime import Decoder

    model, tok = reference_models["llama"]
    model, tok = copy.copy(model), copy.deepcopy(tok)
    model.config, model.generation_config = copy.deepcopy(model.config), copy.deepcopy(model.generation_config)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    prompt = PROMPTS[1]
    greedy = generate(model, tok, "causal", [prompt], {"max_new_tokens": 8, "do_sample": False}, "cpu", 8192, 64,
                      512)[0][0]["tokens"].tolist()
    tok.eos_token = tok.convert_ids_to_tokens(greedy[1])  # the second greedy token is now the tokenizer's EOS
    kwargs = {"max_new_tokens": 8, "do_sample": False, "min_new_tokens": 6}
    plan = plan_generate(model, tok, "causal", [prompt], dict(kwargs), 8192, 64, 512)
    decoder = Decoder(GenerationSettings(), "cpu") if loop else None
    ours = run_generation(model, tok, "causal", plan, "cpu", decoder=decoder)[0][0]["tokens"].tolist()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model.generate(ids, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kwargs)
    plain = plain[0, ids.shape[1]:].tolist()
    assert ours == plain[: plain.index(tok.eos_token_id) + 1] if tok.eos_token_id in plain else ours == plain
    assert len(ours) >= 6 and tok.eos_token_id not in ours[:5]
