"""One model call for all the contexts and candidates of a batch: rows packed under a 4-D attention mask.

The unpacked path (:mod:`llmrl.engine.model.scoring.causal`) makes a pass over each context's own prefix,
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
:data:`PACKABLE_ATTENTION`); the planner decides (:func:`llmrl.engine.model.scoring.planning.plan_batches`,
``packed``). With the frozen trunk, each packed row lists every token path it computes. This module knows
nothing about processes or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmrl.engine.model.reuse.hf_kv import as_cache, cache_of, empty_layers, lay_pieces
from llmrl.engine.model.reuse.trunk import TrunkRow, common_rows, make_caller
from llmrl.engine.model.scoring.planning import COMPLETION, context_offsets, row_inputs
from llmrl.engine.model.scoring.prefixes import cached_starts, encode_common, insert_row
from llmrl.engine.model.scoring.results import (
    BatchPass,
    KeptPositions,
    Pick,
    Scored,
    batch_result,
    prefix_outputs,
    score_positions,
    scored_in_call,
    scored_tokens,
)

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


@dataclass
class _Packing:
    """A packed call's layout and what fills it: per context, the tokens of its prefix it encodes (``owns``, after
    ``starts[a]`` tokens already encoded), their past as held pieces (``pieces_of``), and its candidate rows
    (``segments``: row key -> inputs)."""

    ctxs: list
    layout: _Layout
    owns: list[list[int]]
    starts: list[int]
    segments: list[list[tuple[int, list[int]]]]
    pieces_of: list[list]

    def trunk_rows(self) -> list[TrunkRow]:
        """The token paths each packed row computes (see :meth:`llmrl.engine.model.reuse.trunk.Trunk.call`)."""
        rows = []
        for c, place, own, start, segs in zip(self.ctxs, self.layout.places, self.owns, self.starts, self.segments):
            if place is None:
                continue
            if own:
                rows.append(TrunkRow(place.row, c.prefix, start, list(range(*place.own)), c.adapter))
            for k, inputs in segs:
                rows.append(TrunkRow(place.row, c.prefix + inputs, len(c.prefix), list(range(*place.segments[k])),
                                     c.adapter))
        return rows

    def past_cache(self, shared: list | None):
        """The rows' past keys and values: the common prefix's, once per row (``shared``: per layer (keys,
        values) ``[kv_heads, tokens, head_dim]``), or each context's held pieces at its columns."""
        layout = self.layout
        if layout.past == 0:
            return None
        if shared is not None:
            return as_cache([(k[None].expand(layout.rows, -1, -1, -1), v[None].expand(layout.rows, -1, -1, -1))
                             for k, v in shared])
        layers = empty_layers(next(p[0] for p in self.pieces_of if p), layout.rows, layout.past)
        for layer, (keys, values) in enumerate(layers):
            for place, pieces, length in zip(layout.places, self.pieces_of, self.starts):
                if place is not None and length:
                    lay_pieces(keys, values, place.row, place.past[0], place.past[1], pieces, layer)
        return as_cache(layers)


def run_packed(model, plan, batch, needs, pad_id, device, keep_logits, prefix_cache=None, trunk=None):
    """Run one packed batch (``batch.packed``): the common prefix's pass if planned, then one call for the rest.
    Same arguments and result as :func:`llmrl.engine.model.scoring.run.run_batch`."""
    ctxs = [plan.contexts[i] for i in batch.contexts]
    n = len(ctxs)
    offsets = context_offsets(plan, batch)
    state = BatchPass(needs, n, offsets[-1])
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    segments: list[list[tuple[int, list[int]]]] = [[] for _ in range(n)]
    for a, k in batch.chunks[0] if batch.chunks else []:
        segments[a].append((k, row_inputs(plan, batch.contexts[a], k, needs)))
    common = batch.common
    alpha = attention_per_column(model.config)

    def packing_for(starts, shared_past, pieces_of) -> _Packing:
        owns = [c.prefix[s:] for c, s in zip(ctxs, starts)]
        return _Packing(ctxs, _cheapest_layout(owns, starts, segments, shared_past, alpha), owns, starts, segments,
                        pieces_of)

    if prefix_cache is None:  # every context continues from the common prefix: the layout is known before any call
        packing = packing_for([common] * n, common if common > 0 else None, [])
        calls = ([common_rows(ctxs, common)] if common > 0 else []) + [packing.trunk_rows()]
        call = make_caller(model, needs, trunk, True, lambda: calls)
        common_kv = encode_common(call, ctxs, common, state, device, keep_last) if common > 0 else None
        packing.pieces_of = [[common_kv]] * n if common_kv is not None else [[] for _ in range(n)]
    else:
        call = make_caller(model, needs, trunk, False, lambda: [])
        common_kv = encode_common(call, ctxs, common, state, device, keep_last, prefix_cache) if common > 0 else None
        starts, pieces_of = cached_starts(ctxs, common, common_kv, prefix_cache)
        packing = packing_for(starts, None, pieces_of)
    layout = packing.layout

    if layout.rows:
        scored = _scored(ctxs, layout, batch, offsets, state)
        out, flat, keep = _packed_call(call, model, packing, scored, common_kv if prefix_cache is None else None,
                                       pad_id, device, keep_logits, needs.hidden, prefix_cache is not None)
        state.touched.append(out.logits)
        logits = out.logits if keep_logits else out.logits[keep]
        for a, place in enumerate(layout.places):
            if place is not None and place.own[1] > place.own[0]:
                state.prefix_ends(a, logits, out.hidden_states, (place.row, place.own[1] - 1),
                                  (flat[place.row, place.own[1] - 1],))
        if prefix_cache is not None:
            _insert(prefix_cache, packing, cache_of(out), device)

    context_hidden, candidate_hidden = prefix_outputs(ctxs, offsets, state, device)
    if layout.rows:
        score_positions(state.sink, logits, flat, scored, out.hidden_states, device)
        if needs.candidate_hidden:
            for (a, j), k in batch.cover.items():
                s = layout.places[a].segments[k][0]
                last = len(row_inputs(plan, batch.contexts[a], j, needs)) - 1
                candidate_hidden[offsets[a] + j] = Pick(out.hidden_states, (layout.places[a].row, s + last))
        if needs.context_hidden:
            for a, place in enumerate(layout.places):
                if place is not None and COMPLETION in place.segments:
                    context_hidden[a] = Pick(out.hidden_states, (place.row, place.segments[COMPLETION][1] - 1))
    return batch_result(model, needs, state.sink, state.counts, context_hidden, candidate_hidden, device,
                        state.touched)


def _scored(ctxs, layout: _Layout, batch, offsets, state: BatchPass) -> list[Scored]:
    """The tokens the packed call scores (counted in ``state.counts``)."""
    scored = []
    for (a, j), k in batch.cover.items():
        cand, place = ctxs[a].candidates[j], layout.places[a]
        scored += scored_tokens(cand, place.row, place.segments[k][0], offsets[a] + j)
        state.counts[offsets[a] + j] += scored_in_call(cand)
    return scored


def _packed_call(call, model, packing: _Packing, scored: list[Scored], shared_past, pad_id, device, keep_logits,
                 want_hidden, caching: bool):
    """The packed model call; returns its output, the index of each kept (row, column) among the kept logits,
    and the kept positions (each context's last own token, and the positions ``scored`` reads)."""
    layout = packing.layout
    ids = torch.full((layout.rows, layout.width), pad_id, dtype=torch.long)
    position = torch.zeros((layout.rows, layout.width), dtype=torch.long)
    keep = torch.zeros((layout.rows, layout.width), dtype=torch.bool)
    for c, place, own, start, segs in zip(packing.ctxs, layout.places, packing.owns, packing.starts,
                                          packing.segments):
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
    flat = KeptPositions(keep, [token.row for token in scored], [token.column for token in scored])
    allowed = _mask(layout).to(device)
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":  # eager adds the mask to the scores
        allowed = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)
    past = packing.past_cache(shared_past)
    kwargs = {"input_ids": ids.to(device), "position_ids": position.to(device), "attention_mask": allowed,
              "cache": past, "use_cache": past is not None or caching, "output_hidden_states": want_hidden}
    keep = keep.to(device)
    if keep_logits:
        kwargs["logits_to_keep"] = keep
    out = call(packing.trunk_rows(), **kwargs)
    return out, flat, keep


def _insert(prefix_cache, packing: _Packing, cache, device) -> None:
    """Add each context's prefix to the cache across calls: its past columns, then its own tokens' columns."""
    P = packing.layout.past
    for c, place, start, own in zip(packing.ctxs, packing.layout.places, packing.starts, packing.owns):
        if place is None or not own:
            continue
        ps, os_ = place.past[0], place.own[0]
        insert_row(prefix_cache, c.prefix, cache, place.row, start,
                   lambda t, start=start, ps=ps, os_=os_: ps + t if t < start else P + os_ + (t - start), device)
