"""The unpacked causal path: one planned batch of a causal model, in separate prefix and candidate passes.

A batch runs one pass over the prefix all its contexts share (if any), one over each context's own part of its
shared prefix (left padded, explicit position ids), both keeping their key/value cache, then *candidate passes*
over chunks of candidate rows that attend to that cache, so each context is encoded once whatever the number of
its candidates. A one-token candidate needs no candidate pass at all: the prefix pass's last logits score it.

With the cache across calls (``prefix_cache``, a :class:`~llmrl.engine.model.reuse.prefix_cache.CacheUse`) the
prefix passes encode only the tokens after each prefix's longest cached part (never its last token) and add what
they encoded to the cache. Every call goes through :func:`~llmrl.engine.model.reuse.trunk.make_caller`, told
which token paths each row computes (the frozen trunk records or replays them).

What the calls' outputs become (log-probs, hidden states, the result) is :mod:`llmrl.engine.model.scoring.results`'
job; the batch's plan is :mod:`llmrl.engine.model.scoring.planning`'s, and the calls made are exactly those it
planned. The packed path and seq2seq live in their own modules. It knows nothing about processes or requests.
"""

from __future__ import annotations

import torch

from llmrl.engine.model.reuse.hf_kv import cache_from_pieces, cache_of, select_rows
from llmrl.engine.model.reuse.trunk import candidate_rows, common_rows, make_caller, own_rows
from llmrl.engine.model.scoring.planning import COMPLETION, context_offsets, pad_rows, row_inputs
from llmrl.engine.model.scoring.prefixes import cached_starts, encode_common, insert_row
from llmrl.engine.model.scoring.results import (
    BatchPass,
    BatchResult,
    KeptPositions,
    Pick,
    batch_result,
    prefix_outputs,
    score_positions,
    scored_in_call,
    scored_tokens,
)


def run_causal(model, plan, batch, needs, pad_id, device, keep_logits, prefix_cache=None, trunk=None) -> BatchResult:
    """Run one unpacked causal batch (exactly ``batch.model_calls`` model calls)."""
    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = context_offsets(plan, batch)
    state = BatchPass(needs, len(ctxs), offsets[-1])
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    call = _caller(model, plan, batch, needs, ctxs, trunk, replayable=prefix_cache is None)
    if prefix_cache is None:
        cache, prefix_mask = _encode_prefixes(call, ctxs, batch, state, pad_id, device, keep_last)
    else:
        cache, prefix_mask = _encode_prefixes_with_cache(call, ctxs, batch, state, pad_id, device, keep_last,
                                                         prefix_cache)
    context_hidden, candidate_hidden = prefix_outputs(ctxs, offsets, state, device)

    shared = torch.tensor([c.shared for c in ctxs], device=device)
    row_of = {(a, k): (n, r) for n, chunk in enumerate(batch.chunks) for r, (a, k) in enumerate(chunk)}
    users: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (row, context position, candidate)
    for (a, j), k in batch.cover.items():
        n, r = row_of[a, k]
        users.setdefault(n, []).append((r, a, j))
    for n, chunk in enumerate(batch.chunks):
        inputs = [row_inputs(plan, batch.contexts[a], k, needs) for a, k in chunk]
        ids, rest_mask = pad_rows(inputs, pad_id, left=False, device=device)
        row_ctx = torch.tensor([a for a, _ in chunk], device=device)
        width = ids.shape[1]
        position = shared[row_ctx][:, None] + torch.arange(width, device=device)[None, :]
        scored = []
        for r, a, j in users.get(n, []):
            cand = ctxs[a].candidates[j]
            scored += scored_tokens(cand, r, 0, offsets[a] + j)
            state.counts[offsets[a] + j] += scored_in_call(cand)
        flat = KeptPositions(torch.zeros((len(chunk), width), dtype=torch.bool), [s.row for s in scored],
                             [s.column for s in scored])
        keep = flat.mask.to(device)
        kwargs = {"input_ids": ids, "position_ids": position, "output_hidden_states": needs.hidden}
        if cache is not None:
            kwargs["cache"] = select_rows(cache, row_ctx)
            kwargs["attention_mask"] = torch.cat([prefix_mask[row_ctx], rest_mask], dim=1)
            kwargs["use_cache"] = True
        else:
            kwargs["attention_mask"] = rest_mask
            kwargs["use_cache"] = False
        if keep_logits:
            kwargs["logits_to_keep"] = keep
        out = call(candidate_rows(ctxs, inputs, [a for a, _ in chunk]), **kwargs)
        state.touched.append(out.logits)
        score_positions(state.sink, out.logits if keep_logits else out.logits[keep], flat, scored,
                        out.hidden_states, device)
        if needs.hidden:
            for r, (a, k) in enumerate(chunk):
                if k == COMPLETION:
                    context_hidden[a] = Pick(out.hidden_states, (r, len(inputs[r]) - 1))
            if needs.candidate_hidden:
                for r, a, j in users.get(n, []):
                    last = len(row_inputs(plan, batch.contexts[a], j, needs)) - 1
                    candidate_hidden[offsets[a] + j] = Pick(out.hidden_states, (r, last))

    return batch_result(model, needs, state.sink, state.counts, context_hidden, candidate_hidden, device,
                        state.touched)


def _encode_prefixes(call, ctxs, batch, state: BatchPass, pad_id, device, keep_last):
    """The prefix passes: the prefix all contexts share, then each context's own part. Records where each
    context's prefix ends in ``state``; returns the cache and its attention mask."""
    want_hidden = state.needs.hidden
    cache = prefix_mask = None
    # The prefix every context of the batch shares (an instruction, a system prompt) is encoded once.
    common = batch.common
    if common > 0:
        out = call(common_rows(ctxs, common), input_ids=torch.tensor([ctxs[0].prefix[:common]], device=device),
                   use_cache=True, output_hidden_states=want_hidden, **keep_last)
        state.touched.append(out.logits)
        cache = select_rows(cache_of(out), torch.zeros(len(ctxs), dtype=torch.long, device=device))
        prefix_mask = torch.ones((len(ctxs), common), dtype=torch.long, device=device)
        for a, c in enumerate(ctxs):
            if c.shared == common:
                state.prefix_ends(a, out.logits, out.hidden_states, (0, -1))
    # Then each context's own part of its prefix, left padded after the common part, with explicit positions.
    remainders = [c.prefix[common:] for c in ctxs]
    if batch.own_prefixes:
        ids, own_mask = pad_rows(remainders, pad_id, left=True, device=device)
        position = common + (own_mask.cumsum(-1) - 1).clamp(min=0)
        mask = own_mask if prefix_mask is None else torch.cat([prefix_mask, own_mask], dim=1)
        out = call(own_rows(ctxs, [common] * len(ctxs), remainders, ids.shape[1]), input_ids=ids,
                   attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                   output_hidden_states=want_hidden, **keep_last)
        state.touched.append(out.logits)
        cache, prefix_mask = cache_of(out), mask
        for a, rest in enumerate(remainders):
            if rest:
                state.prefix_ends(a, out.logits, out.hidden_states, (a, -1))
    return cache, prefix_mask


def _encode_prefixes_with_cache(call, ctxs, batch, state: BatchPass, pad_id, device, keep_last, prefix_cache):
    """:func:`_encode_prefixes` through the cache across calls: each pass encodes only the tokens after the longest
    cached prefix (never the last one, so the same calls run with or without hits), then caches what it encoded.
    Rows whose cached parts differ in length are left padded, with explicit positions."""
    want_hidden = state.needs.hidden
    n = len(ctxs)
    common = batch.common
    common_kv = None
    if common > 0:
        common_kv = encode_common(call, ctxs, common, state, device, keep_last, prefix_cache)
        if not batch.own_prefixes:
            cache = cache_from_pieces([[common_kv]] * n, [common] * n)
            return cache, torch.ones((n, common), dtype=torch.long, device=device)
    if not batch.own_prefixes:
        return None, None
    starts, kvs = cached_starts(ctxs, common, common_kv, prefix_cache)
    width = max(starts)
    remainders = [c.prefix[start:] for c, start in zip(ctxs, starts)]
    ids, own_mask = pad_rows(remainders, pad_id, left=True, device=device)
    past_mask = torch.zeros((n, width), dtype=torch.long, device=device)
    for a, start in enumerate(starts):
        past_mask[a, width - start:] = 1
    start_of = torch.tensor(starts, device=device)[:, None]
    position = start_of + (own_mask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([past_mask, own_mask], dim=1)
    out = call(own_rows(ctxs, starts, remainders, ids.shape[1]), input_ids=ids, attention_mask=mask,
               position_ids=position, cache=cache_from_pieces(kvs, starts) if width else None,
               use_cache=True, output_hidden_states=want_hidden, **keep_last)
    state.touched.append(out.logits)
    cache = cache_of(out)
    for a, rest in enumerate(remainders):
        if rest:
            state.prefix_ends(a, out.logits, out.hidden_states, (a, -1))
    own_width = ids.shape[1]
    for a, c in enumerate(ctxs):
        if remainders[a]:
            # This row's tokens, in order: its cached part (ending at column ``width``), then its own part (ending
            # at the last column): two runs of columns.
            end_own, start, rest = width + own_width, starts[a], len(remainders[a])
            insert_row(prefix_cache, c.prefix, cache, a, start,
                       lambda t, start=start, end_own=end_own, rest=rest:
                       width - start + t if t < start else end_own - rest + (t - start), device)
    return cache, mask


def _caller(model, plan, batch, needs, ctxs, trunk, replayable: bool):
    """The batch's model call (see :func:`~llmrl.engine.model.reuse.trunk.make_caller`), told the rows of every
    call the batch makes."""
    def calls():
        common = batch.common
        rows = [common_rows(ctxs, common)] if common > 0 else []
        if batch.own_prefixes:
            remainders = [c.prefix[common:] for c in ctxs]
            rows.append(own_rows(ctxs, [common] * len(ctxs), remainders, max(len(r) for r in remainders)))
        for chunk in batch.chunks:
            rows.append(candidate_rows(ctxs, [row_inputs(plan, batch.contexts[a], k, needs) for a, k in chunk],
                                       [a for a, _ in chunk]))
        return rows

    return make_caller(model, needs, trunk, replayable, calls)
