"""The key/value cache and the trunk store hold what they report, within their cap: edges split while their heads
stay in use and their tails are evicted, again and again; the bytes of the distinct storages the stored tensors
keep alive (walked here, independently of the cache's own count) equal the reported bytes and stay within the
cap. (A split that kept both halves as views of the original edge kept every evicted tail alive behind its head.)"""

from __future__ import annotations

import torch

from llmrl.engine.model.reuse.prefix_cache import PrefixKVCache

HEADS, DIM = 2, 8
BYTES_PER_TOKEN = 2 * HEADS * DIM * 4  # one layer: keys and values, float32


def storages_kept_alive(cache: PrefixKVCache) -> int:
    """The sizes of the distinct storages under every tensor the cache's trees hold."""
    seen, stack = {}, list(cache.roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        for entry in node.kv:
            for t in entry or ():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def kv_of_batch(tokens: list[int]):
    """Keys and values computed for a whole batch row, as a model call gives them: each insertion slices them."""
    keys = torch.randn(HEADS, len(tokens), DIM)
    values = torch.randn(HEADS, len(tokens), DIM)
    return lambda start, end: [(keys[:, start:end], values[:, start:end])]


def test_heads_in_use_while_tails_are_evicted_keep_only_their_own_bytes():
    cap_tokens = 64
    cache = PrefixKVCache(cap_tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN)
    header = list(range(1000, 1004))  # the head every path shares and every call touches again
    for k in range(20):
        path = header + [10_000 * (k + 1) + i for i in range(56)]  # diverges right after the header: a split
        cache.insert(None, path, kv_of_batch(path))
        assert cache.held(None, header) == len(header)
        real = storages_kept_alive(cache)
        assert real == cache.held_bytes(), (k, real, cache.held_bytes())
        assert real <= cache.cap_bytes, f"after {k + 1} paths: {real} bytes alive under a cap of {cache.cap_bytes}"
    assert cache.stats()["evicted_tokens"] > 0


def test_a_split_inside_a_long_edge_leaves_nothing_of_the_evicted_tail():
    cache = PrefixKVCache(100 * BYTES_PER_TOKEN, BYTES_PER_TOKEN)
    long = list(range(90))
    cache.insert(None, long, kv_of_batch(long))
    other = long[:5] + [7000 + i for i in range(60)]  # splits the long edge after 5 tokens; its tail goes
    cache.insert(None, other, kv_of_batch(other))
    assert cache.tokens == 65
    assert storages_kept_alive(cache) == 65 * BYTES_PER_TOKEN == cache.held_bytes()
