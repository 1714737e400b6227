"""The decoding loop's samplers (engine/model/decoding/sampling.py): ``inverse_cdf`` draws from the same distribution
as ``torch.multinomial`` (frequencies against the probabilities, never a token of probability zero), reproduces
under a seed, and inside ``generate`` samples the processed distribution computed by hand from a plain forward."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.decoding.sampling import draw
from llmrl.engine.model.generation import generate, plan_generate

PROBS = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.299, 0.001, 0.0])


@pytest.mark.parametrize("sampler", ["multinomial", "inverse_cdf"])
def test_frequencies_match_the_probabilities_and_zero_is_never_drawn(sampler):
    torch.manual_seed(0)
    rows = 200_000
    drawn = draw(PROBS.expand(rows, -1).contiguous(), sampler)
    counts = torch.bincount(drawn, minlength=len(PROBS)).double()
    expected = PROBS.double() * rows
    sigma = (expected * (1 - PROBS.double())).sqrt()
    assert counts[PROBS == 0].sum() == 0
    assert bool(((counts - expected).abs() <= 5 * sigma + 1e-9).all()), (counts, expected)


def test_edge_rows_one_certain_token_tiny_probabilities_and_unnormalised_rows():
    torch.manual_seed(1)
    probs = torch.zeros(4, 5)
    probs[0, 4] = 1.0  # the last token, certain
    probs[1, 0] = 1.0  # the first token, certain
    probs[2] = torch.tensor([1e-30, 0.0, 1.0 - 1e-7, 0.0, 1e-7])
    probs[3] = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0])  # sums to 0.3: drawn as 1.0 of token 1
    for _ in range(200):
        drawn = draw(probs, "inverse_cdf")
        assert drawn[0] == 4 and drawn[1] == 0 and drawn[2] in (0, 2, 4) and drawn[3] == 1


def test_the_same_seed_draws_the_same_tokens_and_an_unknown_sampler_is_refused():
    probs = torch.softmax(torch.randn(16, 1000), -1)
    torch.manual_seed(5)
    a = draw(probs, "inverse_cdf")
    torch.manual_seed(5)
    assert torch.equal(a, draw(probs, "inverse_cdf"))
    with pytest.raises(ValueError, match="generation.sampler"):
        draw(probs, "gumbel")
    for bad in (float("nan"), 0.0):  # a row of nan, or of zeros: refused, as torch.multinomial refuses it
        broken = probs.clone()
        broken[3] = bad
        with pytest.raises(ValueError, match="not finite or sum to zero"):
            draw(broken, "inverse_cdf")


def test_generate_samples_the_processed_distribution(reference_models):
    """top_k 3, temperature 0.7: each drawn token is among the plain forward's 3 likeliest, and its sampling
    log-prob is that of softmax(top-3 logits / 0.7) computed by hand."""
    model, tok = reference_models["llama"]
    prompts = ["You see a wall", "Goal: go to the red ball. You"]
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": True, "top_k": 3, "temperature": 0.7,
              "num_return_sequences": 4}

    def sample(seed):
        decoder = Decoder(GenerationSettings(sampler="inverse_cdf"), "cpu")
        plan = plan_generate(model, tok, "causal", prompts, kwargs, 8192, 64, 512)
        return generate(model, tok, "causal", plan, "cpu", seed=seed, decoder=decoder), decoder

    ours, decoder = sample(3)
    assert decoder.stats()["calls"] == {"llmrl": 1}
    again, _ = sample(3)
    other, _ = sample(4)
    tokens = [[s["tokens"].tolist() for s in group] for group in ours]
    assert tokens == [[s["tokens"].tolist() for s in group] for group in again]
    assert tokens != [[s["tokens"].tolist() for s in group] for group in other]
    for prompt, group in zip(prompts, ours):
        ids = tok(prompt)["input_ids"]
        for s in group:
            chosen = s["tokens"].tolist()
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids + chosen])).logits[0, len(ids) - 1:-1].float()
            top, where = logits.topk(3, dim=-1)
            picked = torch.tensor(chosen)
            assert bool((where == picked[:, None]).any(-1).all()), "a token outside the top 3 was drawn"
            by_hand = torch.log_softmax(top / 0.7, -1)[(where == picked[:, None])]
            torch.testing.assert_close(s["sampling_logprobs"], by_hand, atol=1e-5, rtol=0)
            torch.testing.assert_close(s["logprobs"], torch.log_softmax(logits, -1)[torch.arange(8), picked],
                                       atol=1e-5, rtol=0)


def test_the_config_names_a_bad_sampler():
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError

    config = load_config(raw={"llms": {"main": {"model": "m", "generation": {"sampler": "inverse_cdf"}}}},
                         check_environment=False, check_plugins=False)
    assert config.llms["main"].generation.sampler == "inverse_cdf"
    with pytest.raises(ConfigError, match="sampler"):
        load_config(raw={"llms": {"main": {"model": "m", "generation": {"sampler": "gumbel"}}}},
                    check_environment=False, check_plugins=False)
