"""Prefix work shared by the unpacked and packed causal paths: the pass over the prefix every context of a batch
shares, and reading and filling the cache across calls (how much of each prefix is held, adding what a call
encoded).

:func:`encode_common` encodes the common prefix from its longest cached part (never including its last token, so
the same calls run with or without hits); :func:`cached_starts` says how much of each context's prefix is encoded
already; :func:`insert_row` adds one row of a call's key/value cache to the cache across calls. The cache itself
(:class:`~llmrl.engine.model.reuse.prefix_cache.PrefixKVCache`) is a data structure; this module is how scoring
uses it. It knows nothing about processes or requests.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.reuse.hf_kv import cache_from_pieces, cache_of
from llmrl.engine.model.reuse.trunk import TrunkRow, shared_adapter
from llmrl.engine.model.scoring.results import BatchPass


def encode_common(call, ctxs, common: int, state: BatchPass, device, keep_last: dict, prefix_cache=None):
    """The pass over the prefix every context shares (from its longest cached part when ``prefix_cache`` is given,
    adding it there); records where the contexts whose shared prefix it is end; returns its keys and values per
    layer (``[kv_heads, common, head_dim]``)."""
    head = ctxs[0].prefix[:common]
    hit, pieces = (prefix_cache.cache.match_pieces(prefix_cache.namespace, head, limit=common - 1)
                   if prefix_cache is not None else (0, []))
    rows = [TrunkRow(0, head, hit, list(range(common - hit)), shared_adapter(ctxs))]
    out = call(rows, input_ids=torch.tensor([head[hit:]], device=device),
               position_ids=torch.arange(hit, common, device=device)[None],
               cache=cache_from_pieces([pieces], [hit]) if hit else None, use_cache=True,
               output_hidden_states=state.needs.hidden, **keep_last)
    state.touched.append(out.logits)
    common_kv = [(layer.keys[0], layer.values[0]) for layer in cache_of(out).layers]
    if prefix_cache is not None:
        prefix_cache.cache.insert(prefix_cache.namespace, head,
                                  lambda i, j: [(k[:, i:j], v[:, i:j]) for k, v in common_kv])
    for a, c in enumerate(ctxs):
        if c.shared == common:
            state.prefix_ends(a, out.logits, out.hidden_states, (0, -1))
    return common_kv


def cached_starts(ctxs, common, common_kv, prefix_cache):
    """Per context: how many prefix tokens are already encoded (cached, or the common prefix just encoded; never
    the last one) and their keys and values, as pieces."""
    store, space = prefix_cache.cache, prefix_cache.namespace
    starts, pieces_of = [], []
    for c in ctxs:
        prefix = c.prefix
        if len(prefix) <= common:  # nothing of its own after the common part (or no prefix at all)
            starts.append(len(prefix))
            pieces_of.append([common_kv] if prefix else [])
            continue
        hit, pieces = store.match_pieces(space, prefix, limit=len(prefix) - 1)
        if hit < common:  # the common part was just encoded (and may have been evicted since)
            hit, pieces = common, [common_kv]
        starts.append(hit)
        pieces_of.append(pieces)
    return starts, pieces_of


def insert_row(prefix_cache, prefix: list[int], cache, row: int, start: int, column_of, device) -> None:
    """Add ``prefix`` to the cache across calls from row ``row`` of a call's ``cache``: token ``t`` of the prefix
    sits at column ``column_of(t)``, tokens before ``start`` in one run of columns and the others in another. A
    request within one run is read as a view."""
    def kv_of(i, j):
        if i >= start or j <= start:  # one run
            lo = column_of(i)
            return [(layer.keys[row][:, lo:lo + j - i], layer.values[row][:, lo:lo + j - i]) for layer in cache.layers]
        columns = torch.tensor([column_of(t) for t in range(i, j)], device=device)
        return [(layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in cache.layers]

    prefix_cache.cache.insert(prefix_cache.namespace, prefix, kv_of)
