"""The key/value cache that lives across scoring calls (issue 14).

The radix tree against hand-worked cases (matches, edge splits, namespaces, LRU eviction under the cap), then the
scoring pipeline with the cache against the same pipeline without it and against plain Hugging Face forward
passes, over an "episode" of calls whose contexts grow by a few tokens each step, for Llama and GPT-2, with
several batches per call, hidden states for heads, and a cap so small that entries are evicted mid-call."""

from __future__ import annotations

import pytest
import torch
from test_scoring import run_plan

from llmrl.engine.model.reuse.prefix_cache import CacheUse, PrefixKVCache, model_bytes_per_token
from llmrl.engine.model.scoring.planning import Needs
from testkit import reference_scores


def kv_for(tokens, layers=2):
    """Per layer, keys and values whose entries are the token ids (so a slice shows which tokens it holds)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return [(t[None, :, None].repeat(1, 1, 2) + 1000 * layer, -t[None, :, None].repeat(1, 1, 2))
            for layer in range(layers)]


def insert(cache, tokens, namespace=None):
    full = kv_for(tokens)
    cache.insert(namespace, tokens, lambda i, j: [(k[:, i:j], v[:, i:j]) for k, v in full])


def held_tokens(kv):
    return kv[0][0][0, :, 0].long().tolist()


def test_a_match_returns_the_longest_cached_prefix_with_its_keys_and_values():
    cache = PrefixKVCache(cap_bytes=10_000, bytes_per_token=10)
    insert(cache, [1, 2, 3, 4])
    insert(cache, [1, 2, 7])  # splits the edge [1, 2, 3, 4] after two tokens
    length, kv = cache.match(None, [1, 2, 3, 9])
    assert length == 3 and held_tokens(kv) == [1, 2, 3]
    assert kv[1][0][0, :, 0].tolist() == [1001.0, 1002.0, 1003.0] and kv[1][1][0, :, 0].tolist() == [-1.0, -2.0, -3.0]
    length, kv = cache.match(None, [1, 2, 7, 8])
    assert length == 3 and held_tokens(kv) == [1, 2, 7]
    assert cache.match(None, [1, 2, 3, 4], limit=2)[0] == 2  # the caller keeps the last token to itself
    assert cache.match(None, [5]) == (0, None)
    lookups = cache.stats()["lookup_tokens"]
    assert cache.held(None, [1, 2, 3, 9]) == 3 and cache.held(None, [1, 2, 7, 8], limit=2) == 2
    assert cache.stats()["lookup_tokens"] == lookups  # a check, not a lookup
    assert cache.tokens == 5  # 1 2 | 3 4 | 7: shared tokens are held once
    stats = cache.stats()
    assert stats["hit_tokens"] == 3 + 3 + 2 and stats["lookup_tokens"] == 4 + 4 + 2 + 1
    assert stats["hit_rate"] == pytest.approx(8 / 11)
    assert stats["bytes"] == 50 and stats["rank_bytes"] == 5 * 2 * 2 * 2 * 4  # 5 tokens, 2 layers, k+v, 2 wide, fp32


def test_namespaces_never_share_entries():
    cache = PrefixKVCache(cap_bytes=10_000, bytes_per_token=1)
    insert(cache, [1, 2, 3], namespace="a")
    assert cache.match("b", [1, 2, 3]) == (0, None)
    assert cache.match(None, [1, 2, 3]) == (0, None)
    assert cache.match("a", [1, 2, 3])[0] == 3


def test_the_least_recently_used_entries_go_first_and_the_cap_always_holds():
    cache = PrefixKVCache(cap_bytes=6, bytes_per_token=1)
    insert(cache, [1, 2, 3])
    insert(cache, [4, 5, 6])
    cache.match(None, [1, 2, 3])  # [1 2 3] is now more recent than [4 5 6]
    insert(cache, [7, 8])
    assert cache.tokens * cache.bytes_per_token <= 6
    assert cache.match(None, [4, 5, 6])[0] == 0
    assert cache.match(None, [1, 2, 3])[0] == 3 and cache.match(None, [7, 8])[0] == 2
    insert(cache, [9, 10, 11, 12, 13, 14, 15, 16])  # alone larger than the cap: only its head is kept
    assert cache.tokens == 6 and cache.match(None, [9, 10, 11, 12, 13, 14, 15, 16])[0] == 6
    assert cache.stats()["evicted_tokens"] == 3 + 5 + 2


def test_clearing_forgets_everything():
    cache = PrefixKVCache(cap_bytes=100, bytes_per_token=1)
    insert(cache, [1, 2, 3], namespace="a")
    cache.clear()
    assert cache.match("a", [1, 2, 3]) == (0, None) and cache.tokens == 0 and cache.stats()["clears"] == 1


def test_bytes_per_token_counts_every_layer_and_key_value_head(reference_models):
    model, _ = reference_models["llama"]
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    expected = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4
    assert model_bytes_per_token(model.config, torch.float32) == expected


HEADER = "Goal: go to the red ball. Actions: turn left, turn right, go forward, pick up. "
STEPS = [" You see a wall 2 steps forward.", " You turned left.", " You see a red ball 1 step left.",
         " You turned left again.", " You see the ball right in front."]
CANDIDATES = [" turn left", " turn right", " go forward", " pick up"]


def episodes(n_envs=3):
    """Per step, one context per environment: the header, then every observation so far (histories grow)."""
    calls = []
    for t in range(len(STEPS)):
        contexts = [HEADER + f"Env {e}." + "".join(STEPS[(s + e) % len(STEPS)] for s in range(t + 1))
                    for e in range(n_envs)]
        calls.append((contexts, [CANDIDATES] * n_envs))
    return calls


def score(model, tok, contexts, candidates, needs=None, budget=8192, rows=64, cache=None, packed=False):
    """Scores and context hidden states of the scoring pipeline (``test_scoring``'s runner), through ``cache``."""
    scores, hidden, _ = run_plan(model, tok, "causal", contexts, candidates, needs, budget, rows, kv_cache=cache,
                                 packed=packed)
    return scores, hidden


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("budget,rows", [(8192, 64), (160, 3)], ids=["one-batch", "several-batches"])
@pytest.mark.parametrize("cap_tokens", [100_000, 40], ids=["roomy", "evicting"])
@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_scores_with_the_cache_equal_scores_without_it_and_plain_hf(reference_models, kind, budget, rows, cap_tokens,
                                                                    packed):
    model, tok = reference_models[kind]
    per_token = model_bytes_per_token(model.config, torch.float32)
    cache = PrefixKVCache(cap_tokens * per_token, per_token)
    needs = Needs(context_hidden=True)
    for contexts, candidates in episodes():
        got, got_hidden = score(model, tok, contexts, candidates, needs, budget, rows, CacheUse(cache, "default"),
                                packed=packed)
        plain, plain_hidden = score(model, tok, contexts, candidates, needs, budget, rows)
        for g, p, e in zip(got, plain, reference_scores(model, tok, contexts, candidates)):
            torch.testing.assert_close(g, p, atol=1e-5, rtol=0)
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
        for g, p in zip(got_hidden, plain_hidden):
            torch.testing.assert_close(g, p, atol=1e-5, rtol=0)
        assert cache.tokens * per_token <= cache.cap_bytes
    stats = cache.stats()
    if cap_tokens > 1000:  # every step after the first finds the previous context cached
        assert stats["hit_rate"] > 0.6, stats
    else:
        assert stats["evicted_tokens"] > 0, stats


@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
def test_in_float64_the_cache_changes_scores_by_rounding_only(reference_models, packed):
    """In float32 the paths with and without the cache add the same terms in different orders (different batch
    shapes), so they differ by float32 rounding (measured: both within 2e-5 of a float64 reference on ~20-nat
    scores). In float64 rounding is ~1e-14: any difference larger than that would be the cache's own error."""
    import copy

    model, tok = reference_models["llama"]
    model = copy.deepcopy(model).double()
    per_token = model_bytes_per_token(model.config, torch.float64)
    cache = PrefixKVCache(10**9, per_token)
    needs = Needs(context_hidden=True)
    for contexts, candidates in episodes():
        got, got_hidden = score(model, tok, contexts, candidates, needs, cache=CacheUse(cache, "default"),
                                packed=packed)
        plain, plain_hidden = score(model, tok, contexts, candidates, needs, packed=packed)
        for g, p, e in zip(got, plain, reference_scores(model, tok, contexts, candidates)):
            assert g.dtype == torch.float64
            torch.testing.assert_close(g, p, atol=1e-10, rtol=0)
            torch.testing.assert_close(g, e, atol=1e-10, rtol=0)
        for g, p in zip(got_hidden, plain_hidden):
            torch.testing.assert_close(g, p, atol=1e-10, rtol=0)
    assert cache.stats()["hit_rate"] > 0.6


def test_an_adapter_reads_only_its_own_entries(reference_models):
    """Keys computed under one namespace are never offered to another: a second namespace starts cold."""
    model, tok = reference_models["llama"]
    per_token = model_bytes_per_token(model.config, torch.float32)
    cache = PrefixKVCache(10**9, per_token)
    contexts, candidates = episodes()[0]
    score(model, tok, contexts, candidates, cache=CacheUse(cache, "a"))
    hits = cache.stats()["hit_tokens"]
    score(model, tok, contexts, candidates, cache=CacheUse(cache, "b"))
    assert cache.stats()["hit_tokens"] - hits == hits  # the same hits as the first call: within the call only
    score(model, tok, contexts, candidates, cache=CacheUse(cache, "a"))
    assert cache.stats()["hit_tokens"] - 2 * hits > hits  # a warm namespace finds the whole prefixes


def test_a_common_prefix_the_cache_holds_gets_no_pass_of_its_own(reference_models):
    """Packed, with the cache: once the header is cached, a call is one model call (no pass over the common
    prefix), and its scores still equal plain Hugging Face's."""
    from llmrl.engine.model.scoring.planning import plan_batches
    from llmrl.engine.model.scoring.tokenization import tokenize

    model, tok = reference_models["llama"]
    per_token = model_bytes_per_token(model.config, torch.float32)
    cache = CacheUse(PrefixKVCache(10**9, per_token), None)
    (first, first_cands), (second, second_cands) = episodes()[:2]
    held = lambda ids: cache.cache.held(None, ids)  # noqa: E731

    def planned(contexts, candidates):
        plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
        return plan_batches(plan, 8192, 64, Needs(), packed=True, cached=held)

    (batch,) = planned(first, first_cands)
    assert batch.common > 0 and batch.model_calls == 2  # nothing cached yet: the header is encoded once
    score(model, tok, first, first_cands, cache=cache, packed=True)
    (batch,) = planned(second, second_cands)
    assert batch.common == 0 and batch.model_calls == 1
    got, _ = score(model, tok, second, second_cands, cache=cache, packed=True)
    for g, e in zip(got, reference_scores(model, tok, second, second_cands)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def lora_top_model(model, dtype, layers=2, top=1):
    """A copy of ``model`` (or, with more ``layers``, a deeper random model of its shape) with LoRA on its ``top``
    layers (non-zero, so that it changes their output)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    if layers != model.config.num_hidden_layers:
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = layers
        model = type(model)(config).eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                        layers_to_transform=list(range(layers - top, layers)))
    peft = get_peft_model(copy.deepcopy(model).to(dtype), config)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return peft


def change_the_adapter(model, seed):
    """What an update does to a LoRA-top model: its adapter's weights move, nothing below changes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)], ids=["float32", "float64"])
@pytest.mark.parametrize("packed", [False, True], ids=["chunked", "packed"])
@pytest.mark.parametrize("layers,top", [(2, 1), (4, 2)], ids=["top-1-of-2", "top-2-of-4"])
def test_after_an_update_of_the_top_layers_entries_keep_the_bottom_and_recompute_the_top(
        reference_models, dtype, tolerance, packed, layers, top):
    """With LoRA on the top layers and a trunk, ``keep_layers_below`` (what an update does) keeps each entry's
    bottom layers; the next calls refresh the top layers from the trunk and score as if nothing had been cached."""
    from llmrl.engine.model.reuse.trunk import Trunk, trunk_depth

    base, tok = reference_models["llama"]
    model = lora_top_model(base, dtype, layers, top)
    trunk = Trunk(model, trunk_depth(model), 2**30)
    assert trunk.depth == layers - top
    per_token = model_bytes_per_token(model.config, dtype)
    cache = PrefixKVCache(10**9, per_token)
    steps = episodes()
    for t, (contexts, candidates) in enumerate(steps):
        if t in (2, 4):
            change_the_adapter(model, seed=t)
            cache.keep_layers_below(trunk.depth)
        with trunk.active("record"):
            got, _, _ = run_plan(model, tok, "causal", contexts, candidates, kv_cache=CacheUse(cache, "default"),
                                 packed=packed, trunk=trunk)
        plain, _, _ = run_plan(model, tok, "causal", contexts, candidates, packed=packed)
        for g, p, e in zip(got, plain, reference_scores(model, tok, contexts, candidates)):
            # (a summed score of order 40 rounds by a few 1e-6 in float32: measured 1.1e-5 on an AVX2-only EPYC)
            torch.testing.assert_close(g, p, atol=tolerance, rtol=tolerance / 10)
            torch.testing.assert_close(g, e, atol=max(tolerance, 1e-4) if dtype == torch.float32 else tolerance,
                                       rtol=0)
    stats = cache.stats()
    assert stats["clears"] == 0 and stats["partial_clears"] == 2 and stats["refreshed_tokens"] > 0, stats
    assert stats["dropped_stale_tokens"] == 0 and stats["hit_rate"] > 0.6, stats


def test_stale_entries_the_trunk_cannot_recompute_are_dropped_and_never_read(reference_models):
    """A trunk that holds nothing (its cap is tiny) cannot recompute the top layers: the stale entries are dropped,
    the call encodes everything, and the scores are still exact. Without any refresh, reading a stale entry raises
    instead of handing out keys of the old weights."""
    from llmrl.engine.model.reuse.trunk import Trunk, trunk_depth

    base, tok = reference_models["llama"]
    model = lora_top_model(base, torch.float32)
    per_token = model_bytes_per_token(model.config, torch.float32)
    (first, first_cands), (second, second_cands) = episodes()[:2]
    cache = PrefixKVCache(10**9, per_token)
    empty_trunk = Trunk(model, trunk_depth(model), 1)
    run_plan(model, tok, "causal", first, first_cands, kv_cache=CacheUse(cache, None))
    change_the_adapter(model, seed=1)
    cache.keep_layers_below(empty_trunk.depth)
    with empty_trunk.active("record"):
        got, _, _ = run_plan(model, tok, "causal", second, second_cands, kv_cache=CacheUse(cache, None),
                             trunk=empty_trunk)
    for g, e in zip(got, reference_scores(model, tok, second, second_cands)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    assert cache.stats()["dropped_stale_tokens"] > 0 and cache.stats()["refreshed_tokens"] == 0

    cache = PrefixKVCache(10**9, per_token)
    run_plan(model, tok, "causal", first, first_cands, kv_cache=CacheUse(cache, None))
    cache.keep_layers_below(1)
    with pytest.raises(RuntimeError, match="stale"):
        run_plan(model, tok, "causal", second, second_cands, kv_cache=CacheUse(cache, None))


def stale_cache(*sequences, layers=3, depth=1):
    """A cache holding ``sequences`` (fake keys and values: the token ids, see :func:`kv_for`), then told that the
    layers from ``depth`` up changed."""
    cache = PrefixKVCache(10**6, 1)
    for tokens in sequences:
        full = kv_for(tokens, layers)
        cache.insert(None, tokens, lambda i, j, full=full: [(k[:, i:j], v[:, i:j]) for k, v in full])
    cache.keep_layers_below(depth)
    return cache


def recompute(cannot=(), layers=3, depth=1, seen=None):
    """A ``compute`` for :meth:`PrefixKVCache.refresh`: the fake top layers of each path (None for a path in
    ``cannot``), recording the paths it was asked for in ``seen``."""
    def compute(paths):
        if seen is not None:
            seen.extend(paths)
        return [None if tuple(p) in cannot else kv_for(p, layers)[depth:] for p in paths]
    return compute


def test_refresh_fills_what_can_be_computed_before_dropping_what_cannot():
    """Two paths share a stale header; the one that cannot be recomputed comes first: the other is refreshed whole,
    header included, and only the failed path's own entry is dropped (the header stays)."""
    cache = stale_cache([1, 2, 3, 4], [1, 2, 5, 6])
    cache.refresh(None, [[1, 2, 5, 6], [1, 2, 3, 4]], recompute(cannot={(1, 2, 5, 6)}))
    length, kv = cache.match(None, [1, 2, 3, 4])
    assert length == 4
    for got, want in zip(kv, kv_for([1, 2, 3, 4], 3)):  # every layer, the recomputed top ones included
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    assert cache.held(None, [1, 2, 5, 6]) == 2
    stats = cache.stats()
    assert stats["tokens"] == 4 and stats["refreshed_tokens"] == 4 and stats["dropped_stale_tokens"] == 2


def test_refresh_splits_an_entry_matched_in_part_and_computes_no_path_twice():
    """A prefix that ends inside an entry refreshes only up to its end (the rest stays stale, and reading it
    raises); a path that another path extends is not computed on its own."""
    cache = stale_cache([1, 2, 3, 4, 5, 6])
    seen = []
    cache.refresh(None, [[1, 2, 3], [1, 2]], recompute(seen=seen))
    assert seen == [[1, 2, 3]]
    length, kv = cache.match(None, [1, 2, 3])
    assert length == 3 and held_tokens(kv) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="stale"):
        cache.match(None, [1, 2, 3, 4, 5])
    assert cache.stats()["tokens"] == 6
