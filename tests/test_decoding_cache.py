"""llmrl's decoding loop with the key/value cache across calls (``kv_cache_mb``): a multi-turn episode decodes the
same tokens and log-probs as Hugging Face's ``generate`` without any cache (greedy) and as the loop without the cache
(seeded sampling), and from the second turn on each prompt prefills only its new tokens (the last sampled token and
the observation): its history is read from the cache, never encoded again."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.model.reuse.prefix_cache import CacheUse, PrefixKVCache, model_bytes_per_token

OBSERVATIONS = [" You see a door.", " It is locked. A key lies on the floor nearby.", " Nothing happens.",
                " The door opens onto a long corridor."]
SETTINGS = {"dynamic": {}, "merged-static": {"merge_adapter": True, "static_cache": True, "length_bucket": 16}}


@pytest.fixture(scope="module")
def lora_llama(reference_models):
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model, targets=("q_proj", "v_proj")), tok


def run(model, tok, prompts, kwargs, decoder=None, cache=None, seed=None):
    plan = plan_generate(model, tok, "causal", prompts, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=seed, prefix_cache=cache, decoder=decoder)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_multi_turn_episode_prefills_only_new_tokens_and_decodes_as_without_the_cache(lora_llama, name):
    model, tok = lora_llama
    cache = CacheUse(PrefixKVCache(10**9, model_bytes_per_token(model.config, torch.float32)), "default")
    cached = Decoder(GenerationSettings(**SETTINGS[name]), "cpu")
    prompts = [tok.encode(f"Game {e}. You are in a hall with {e + 2} doors.") for e in range(3)]
    observations = [tok.encode(o, add_special_tokens=False) for o in OBSERVATIONS]
    fed: list[tuple] = []  # the token shapes the model's embedding reads, call by call
    embedding = model.get_base_model().get_input_embeddings()
    hook = embedding.register_forward_hook(lambda module, args, out: fed.append(tuple(args[0].shape)))
    for turn in range(4):
        sampling = turn == 1
        kwargs = {"max_new_tokens": 5, "do_sample": sampling, "num_return_sequences": 2 if sampling else 1}
        before = dict(cache.cache.generation)
        fed.clear()
        got = run(model, tok, prompts, kwargs, cached, cache, seed=turn)
        prefill = fed[0]  # the loop's first model call: what it really encoded
        # greedy: Hugging Face's generate without any cache; sampling: the loop without the cache, same seed
        reference = Decoder(GenerationSettings(**SETTINGS[name]), "cpu") if sampling else None
        hook.remove()
        want = run(model, tok, prompts, kwargs, reference, seed=turn)
        hook = embedding.register_forward_hook(lambda module, args, out: fed.append(tuple(args[0].shape)))
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                assert torch.equal(a["tokens"], b["tokens"]), (turn, a["tokens"], b["tokens"])
                torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=3e-5, rtol=0)
        counts = {k: v - before[k] for k, v in cache.cache.generation.items()}
        rows = len(prompts) * kwargs["num_return_sequences"]
        assert counts["prompts"] == rows
        assert counts["prompt_tokens"] == sum(map(len, prompts)) * kwargs["num_return_sequences"]
        if turn == 0:
            assert counts["encoded_tokens"] == sum(map(len, prompts))  # each prompt once, for all its samples
            assert prefill == (len(prompts), max(map(len, prompts)))  # the left-padded prompts
        else:  # one batch: each prompt encodes the batch's longest new part, the last token and an observation
            new = max(len(observations[(turn - 1 + e) % 4]) for e in range(3)) + 1
            assert counts["encoded_tokens"] == len(prompts) * new, (turn, counts)
            assert prefill == (len(prompts), new), (turn, prefill)
        assert cached.stats()["calls"] == {"llmrl": turn + 1}
        prompts = [p + g[0]["tokens"].tolist() + observations[(turn + e) % 4]
                   for e, (p, g) in enumerate(zip(prompts, got))]
    hook.remove()
