"""One model call for all the contexts and candidates of a batch: rows packed under a 4-D attention mask.

The unpacked path (:func:`llmrl.engine.model.scoring.run_batch`) makes a pass over each context's own prefix,
left padded to the longest, then passes over chunks of candidate rows that each copy their context's keys
and values. Every model call reads every weight once, which on a CPU costs as much as encoding dozens of
tokens, and padding costs as much as real tokens: with the cache across calls, a context often has 2 tokens
to encode and is padded to 20. Here, after the pass over the prefix every context of the batch shares (when
the plan has one), a *single* call encodes, for every context, the part of its prefix not encoded yet (by
that pass or by the cache across calls) followed by the inputs of each of its candidate rows:

- a context and its candidate rows sit side by side in one row; short contexts may share a row, and rows
  are right padded to the widest. Sharing saves padding but costs attention: every token of a row is
  scored against every column of the row (past and tokens), and the mask throws most of that away. The
  layout is the cheapest of a few (rows of at most ``span`` attended columns, for each span of
  :data:`ROW_SPANS`, 0 being a row per context) by a cost model: padded tokens x (1 + alpha x attended
  columns), alpha being a layer's attention work per column relative to its linear work per token, from
  the model's shape (:func:`attention_per_column`);
- an explicit 4-D mask says who attends to what: a context's tokens attend to its past (its cached prefix,
  or the common prefix) and causally to each other; a candidate's tokens to its context's past, to its
  context's tokens and causally to each other; nothing attends across contexts or candidates;
- positions are explicit: every token has the position it has in its own sequence.

So each token sees exactly what it sees in the unpacked path and the results are the same (to float
rounding). Needs an attention implementation that takes a 4-D mask (``sdpa``, ``eager``: see
:data:`PACKABLE_ATTENTION`); the planner decides (:func:`llmrl.engine.model.batching.plan_batches`,
``packed``). With the frozen trunk, each packed row lists every token path it computes. This module knows
nothing about processes or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmrl.engine.model import pass_results, scoring
from llmrl.engine.model.batching import COMPLETION, row_inputs
from llmrl.engine.model.hf_cache import cache_of

PACKABLE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4-D mask as given
ROW_SPANS = (0, 256, 512, 1024, 2048)  # layouts tried: at most this many columns (past and tokens) per shared row


@dataclass
class _Place:
    """Where one context's tokens sit in the packed call."""

    row: int
    past: tuple[int, int]  # its past (cached or common prefix) among the row's past columns
    own: tuple[int, int]  # its own prefix tokens among the row's token columns
    segments: dict[int, tuple[int, int]] = field(default_factory=dict)  # candidate row (or COMPLETION) -> columns


@dataclass
class _Layout:
    places: list[_Place | None]  # per context (None: nothing to encode)
    rows: int
    width: int  # token columns
    past: int  # past columns


def attention_per_column(config) -> float:
    """A layer's attention work for one token and one attended column (query-key and value products), relative to
    its linear work for one token (its weights' multiply-adds)."""
    text = config.get_text_config()
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    mlp_matrices = 2 if hasattr(text, "n_inner") else 3  # GPT-2's MLP has two; gated ones (Llama, Qwen, ...) three
    linear = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + mlp_matrices * hidden * inner
    return 2 * heads * head_dim / linear


def _cheapest_layout(owns, pasts, segments, shared_past: int | None, alpha: float) -> _Layout:
    """The layout of :data:`ROW_SPANS` with the least estimated work: padded tokens x (1 + alpha x columns)."""
    best, best_cost = None, float("inf")
    for span in ROW_SPANS:
        layout = _layout(owns, pasts, segments, shared_past, span)
        cost = layout.rows * layout.width * (1 + alpha * (layout.past + layout.width))
        if cost < best_cost:
            best, best_cost = layout, cost
    return best


def _layout(owns: list[list[int]], pasts: list[int], segments: list[list[tuple[int, list[int]]]],
            shared_past: int | None, span_cap: int) -> _Layout:
    """Place contexts in rows, in order, a row taking more contexts while its columns stay within ``span_cap``.
    ``pasts[a]``: the length of context ``a``'s past; ``shared_past``: the length of a past every row holds once
    (the common prefix), or None when each context brings its own."""
    places: list[_Place | None] = []
    row, used_tokens, used_past, span = -1, 0, 0, span_cap + 1
    widths, past_widths = [], []
    for own, past, segs in zip(owns, pasts, segments):
        tokens = len(own) + sum(len(inputs) for _, inputs in segs)
        if tokens == 0:
            places.append(None)
            continue
        mine = tokens + (0 if shared_past is not None else past)
        if row < 0 or span + mine > span_cap:
            row, used_tokens, used_past = row + 1, 0, 0
            span = shared_past or 0
            widths.append(0)
            past_widths.append(shared_past or 0)
        past_cols = (0, shared_past) if shared_past is not None else (used_past, used_past + past)
        place = _Place(row, past_cols, (used_tokens, used_tokens + len(own)))
        at = used_tokens + len(own)
        for k, inputs in segs:
            place.segments[k] = (at, at + len(inputs))
            at += len(inputs)
        places.append(place)
        used_tokens = at
        if shared_past is None:
            used_past += past
            past_widths[row] = used_past
        widths[row] = used_tokens
        span += mine
    return _Layout(places, row + 1, max(widths, default=0), max(past_widths, default=0))


def _mask(layout: _Layout) -> torch.Tensor:
    """``[rows, 1, tokens, past + tokens]``, True where a token may attend."""
    P, Q = layout.past, layout.width
    allowed = torch.zeros((layout.rows, Q, P + Q), dtype=torch.bool)
    covered = torch.zeros((layout.rows, Q), dtype=torch.bool)
    tril = torch.ones((Q, Q), dtype=torch.bool).tril()
    for place in layout.places:
        if place is None:
            continue
        r, (ps, pe), (os_, oe) = place.row, place.past, place.own
        spans = [(os_, oe)] + list(place.segments.values())
        for s, e in spans:
            allowed[r, s:e, ps:pe] = True
            allowed[r, s:e, P + s:P + e] = tril[: e - s, : e - s]
            covered[r, s:e] = True
        for s, e in spans[1:]:
            allowed[r, s:e, P + os_:P + oe] = True
    for r, c in (~covered).nonzero().tolist():  # padding attends to itself only (no row without a key)
        allowed[r, c, P + c] = True
    return allowed[:, None]


def _past_cache(layout: _Layout, pieces_of: list[list], pasts: list[int], shared: list | None, device):
    """The rows' past keys and values: the common prefix's, once per row (``shared``: per layer (keys, values)
    ``[kv_heads, tokens, head_dim]``), or each context's cached pieces at its columns."""
    from transformers import DynamicCache

    if layout.past == 0:
        return None
    if shared is not None:
        layers = [(k[None].expand(layout.rows, -1, -1, -1), v[None].expand(layout.rows, -1, -1, -1))
                  for k, v in shared]
        return DynamicCache(ddp_cache_data=layers)
    sample = next(p[0] for p in pieces_of if p)
    layers = []
    for layer, (k0, v0) in enumerate(sample):
        keys = k0.new_zeros((layout.rows, k0.shape[0], layout.past, k0.shape[2]))
        values = v0.new_zeros((layout.rows, v0.shape[0], layout.past, v0.shape[2]))
        for place, pieces, length in zip(layout.places, pieces_of, pasts):
            if place is None or not length:
                continue
            at, end = place.past
            for piece in pieces:
                take = min(piece[layer][0].shape[1], end - at)
                if take <= 0:
                    break
                keys[place.row, :, at:at + take] = piece[layer][0][:, :take]
                values[place.row, :, at:at + take] = piece[layer][1][:, :take]
                at += take
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


def _trunk_rows(ctxs, layout: _Layout, owns, starts, segments) -> list[tuple]:
    """The token paths each packed row computes (see :meth:`llmrl.engine.model.trunk.Trunk.call`)."""
    rows = []
    for c, place, own, start, segs in zip(ctxs, layout.places, owns, starts, segments):
        if place is None:
            continue
        if own:
            rows.append((place.row, c.prefix, start, list(range(*place.own))))
        for k, inputs in segs:
            rows.append((place.row, c.prefix + inputs, len(c.prefix), list(range(*place.segments[k]))))
    return rows


def run_packed(model, plan, batch, needs, pad_id, device, keep_logits, kv_cache=None, trunk=None):
    """Run one packed batch (``batch.packed``): the common prefix's pass if planned, then one call for the rest.
    Same arguments and result as :func:`llmrl.engine.model.scoring.run_batch`."""
    ctxs = [plan.contexts[i] for i in batch.contexts]
    n = len(ctxs)
    offsets = scoring.context_offsets(plan, batch)
    layers, want_hidden = needs.layers, needs.hidden
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    sink = pass_results.TokenSink(needs)
    counts = torch.zeros(offsets[-1], dtype=torch.long)
    last_logits: list = [None] * n
    last_hidden: list = [None] * n
    touched: list[torch.Tensor] = []
    segments: list[list[tuple[int, list[int]]]] = [[] for _ in range(n)]
    for a, k in batch.chunks[0] if batch.chunks else []:
        segments[a].append((k, row_inputs(plan, batch.contexts[a], k, needs)))
    common = batch.common
    alpha = attention_per_column(model.config)

    def layout_for(starts, shared_past):
        owns = [c.prefix[s:] for c, s in zip(ctxs, starts)]
        return owns, _cheapest_layout(owns, starts, segments, shared_past, alpha)

    if kv_cache is None:  # every context continues from the common prefix: the layout is known before any call
        starts = [common] * n
        owns, layout = layout_for(starts, common if common > 0 else None)
        calls = ([scoring._common_rows(ctxs, common)] if common > 0 else []) + [
            _trunk_rows(ctxs, layout, owns, starts, segments)]
        call = scoring.make_caller(model, needs, trunk, True, lambda: calls)
        common_kv = _common_pass(call, ctxs, common, needs, device, keep_last, last_logits, last_hidden, touched,
                                 None) if common > 0 else None
        pieces_of = [[common_kv]] * n if common_kv is not None else [[] for _ in range(n)]
    else:
        call = scoring.make_caller(model, needs, trunk, False, lambda: [])
        common_kv = _common_pass(call, ctxs, common, needs, device, keep_last, last_logits, last_hidden, touched,
                                 kv_cache) if common > 0 else None
        starts, pieces_of = _cached_starts(ctxs, common, common_kv, kv_cache)
        owns, layout = layout_for(starts, None)

    if layout.rows:
        out, flat, keep = _packed_call(call, model, ctxs, layout, owns, starts, segments, pieces_of, common_kv, kv_cache,
                                       batch, plan, needs, pad_id, device, keep_logits, want_hidden)
        touched.append(out.logits)
        logits = out.logits if keep_logits else out.logits[keep]
        for a, place in enumerate(layout.places):
            if place is not None and place.own[1] > place.own[0]:
                last_logits[a] = pass_results.Pick(logits, (flat[place.row, place.own[1] - 1],))
                last_hidden[a] = pass_results.Pick(out.hidden_states, (place.row, place.own[1] - 1)) \
                    if want_hidden else None
        if kv_cache is not None:
            _insert(kv_cache, ctxs, layout, starts, owns, cache_of(out), device)

    context_hidden, candidate_hidden = pass_results.prefix_outputs(ctxs, offsets, needs, sink, counts, last_logits,
                                                               last_hidden, device)
    if layout.rows:
        wanted = []
        for (a, j), k in batch.cover.items():
            cand, (s, _) = ctxs[a].candidates[j], layout.places[a].segments[k]
            for t in range(max(cand.first_scored - 1, 0), len(cand.rest) - 1):
                wanted.append(((layout.places[a].row, s + t), cand.rest[t + 1], offsets[a] + j,
                               t + 1 - cand.first_scored))
            counts[offsets[a] + j] += len(cand.rest) - max(cand.first_scored, 1)
            if needs.candidate_hidden:
                last = len(row_inputs(plan, batch.contexts[a], j, needs)) - 1
                candidate_hidden[offsets[a] + j] = pass_results.Pick(out.hidden_states, (layout.places[a].row, s + last))
        if wanted:
            logits = pass_results.at_least_float32(logits)
            norm = torch.logsumexp(logits, dim=-1)
            index = torch.tensor([flat[w[0]] for w in wanted], device=device)
            targets = torch.tensor([w[1] for w in wanted], device=device)
            hidden = None
            if needs.token_hidden:  # position t predicts rest[t + 1]
                rows = torch.tensor([w[0][0] for w in wanted], device=device)
                cols = torch.tensor([w[0][1] for w in wanted], device=device)
                hidden = pass_results.at(out.hidden_states, layers, rows, cols)
            sink.add(logits[index, targets] - norm[index], [w[2] for w in wanted],
                     [w[3] for w in wanted] if needs.per_token else None, targets, logits, norm, index, hidden)
        if needs.context_hidden:
            for a, place in enumerate(layout.places):
                if place is not None and COMPLETION in place.segments:
                    context_hidden[a] = pass_results.Pick(out.hidden_states, (place.row, place.segments[COMPLETION][1] - 1))
    return pass_results.batch_result(model, needs, sink, counts, context_hidden, candidate_hidden, device, touched)


def _common_pass(call, ctxs, common, needs, device, keep_last, last_logits, last_hidden, touched, kv_cache):
    """The pass over the prefix every context shares (from its longest cached part, never including its last
    token); returns its keys and values per layer (``[kv_heads, common, head_dim]``)."""
    head = ctxs[0].prefix[:common]
    hit, pieces = (kv_cache.cache.match_pieces(kv_cache.namespace, head, limit=common - 1) if kv_cache is not None
                   else (0, []))
    out = call([(0, head, hit, list(range(common - hit)))], input_ids=torch.tensor([head[hit:]], device=device),
               position_ids=torch.arange(hit, common, device=device)[None],
               cache=scoring._cache_of([pieces], [hit], device) if hit else None, use_cache=True,
               output_hidden_states=needs.hidden, **keep_last)
    touched.append(out.logits)
    common_kv = [(layer.keys[0], layer.values[0]) for layer in cache_of(out).layers]
    if kv_cache is not None:
        kv_cache.cache.insert(kv_cache.namespace, head, lambda i, j: [(k[:, i:j], v[:, i:j]) for k, v in common_kv])
    for a, c in enumerate(ctxs):
        if c.shared == common:
            last_logits[a] = pass_results.Pick(out.logits, (0, -1))
            last_hidden[a] = pass_results.Pick(out.hidden_states, (0, -1)) if needs.hidden else None
    return common_kv


def _cached_starts(ctxs, common, common_kv, kv_cache):
    """Per context: how many prefix tokens are already encoded (cached, or the common prefix just encoded; never
    the last one) and their keys and values, as pieces."""
    store, space = kv_cache.cache, kv_cache.namespace
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


def _packed_call(call, model, ctxs, layout, owns, starts, segments, pieces_of, common_kv, kv_cache, batch, plan, needs,
                 pad_id, device, keep_logits, want_hidden):
    """The packed model call; returns its output, the index of each kept (row, column) among the kept logits,
    and the kept positions."""
    ids = torch.full((layout.rows, layout.width), pad_id, dtype=torch.long)
    position = torch.zeros((layout.rows, layout.width), dtype=torch.long)
    keep = torch.zeros((layout.rows, layout.width), dtype=torch.bool)
    for c, place, own, start, segs in zip(ctxs, layout.places, owns, starts, segments):
        if place is None:
            continue
        s, e = place.own
        if own:
            ids[place.row, s:e] = torch.tensor(own)
            position[place.row, s:e] = torch.arange(start, start + len(own))
            keep[place.row, e - 1] = True
        for k, inputs in segs:
            s, e = place.segments[k]
            ids[place.row, s:e] = torch.tensor(inputs)
            position[place.row, s:e] = torch.arange(len(c.prefix), len(c.prefix) + len(inputs))
    for (a, j), k in batch.cover.items():
        cand, (s, _) = ctxs[a].candidates[j], layout.places[a].segments[k]
        for t in range(max(cand.first_scored - 1, 0), len(cand.rest) - 1):
            keep[layout.places[a].row, s + t] = True
    flat = {tuple(rc): i for i, rc in enumerate(keep.nonzero().tolist())}  # boolean selection is row-major
    allowed = _mask(layout).to(device)
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":  # eager adds the mask to the scores
        allowed = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)
    past = _past_cache(layout, pieces_of, starts, common_kv if kv_cache is None else None, device)
    kwargs = {"input_ids": ids.to(device), "position_ids": position.to(device), "attention_mask": allowed,
              "cache": past, "use_cache": past is not None or kv_cache is not None,
              "output_hidden_states": want_hidden}
    keep = keep.to(device)
    if keep_logits:
        kwargs["logits_to_keep"] = keep
    out = call(_trunk_rows(ctxs, layout, owns, starts, segments), **kwargs)
    return out, flat, keep


def _insert(kv_cache, ctxs, layout, starts, owns, cache, device) -> None:
    """Add each context's prefix to the cache across calls: its past columns, then its own tokens' columns."""
    P = layout.past
    for c, place, start, own in zip(ctxs, layout.places, starts, owns):
        if place is None or not own:
            continue
        r, ps, os_ = place.row, place.past[0], place.own[0]

        def column_of(t, start=start, ps=ps, os_=os_):
            return ps + t if t < start else P + os_ + (t - start)

        def kv_of(i, j, r=r, start=start, column_of=column_of):
            if i >= start or j <= start:  # one run of columns
                lo = column_of(i)
                return [(layer.keys[r][:, lo:lo + j - i], layer.values[r][:, lo:lo + j - i]) for layer in cache.layers]
            columns = torch.tensor([column_of(t) for t in range(i, j)], device=device)
            return [(layer.keys[r][:, columns], layer.values[r][:, columns]) for layer in cache.layers]

        kv_cache.cache.insert(kv_cache.namespace, c.prefix, kv_of)
