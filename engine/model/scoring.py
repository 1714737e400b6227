"""Run planned batches of a scoring request through the model: log-probs of candidates, hidden states for heads.

For a causal model a batch runs one pass over the prefix all its contexts share (if any), one over each
context's own part of its shared prefix (left padded, explicit position ids), both keeping their key/value
cache, then *candidate passes* over chunks of candidate rows that attend to that cache, so each context is
encoded once whatever the number of its candidates. A one-token candidate needs no candidate pass at all:
the prefix pass's last logits score it. Logits are computed only at the positions that are scored
(``logits_to_keep``), in float32, and reduced to log-probs without materialising a full log-softmax.

A seq2seq model's batches run in :mod:`llmrl.engine.model.seq2seq_scoring`; what a pass collects and returns is
in :mod:`llmrl.engine.model.pass_results`.

Each scored token's log-prob is computed once; candidates' scores are their sums. When the request asks for them
(``Needs.per_token``), the per-token log-probs are also kept apart, with each token's id, candidate and position
within the candidate's scored tokens, and (``Needs.entropy``) the entropy of the distribution the token was drawn
from, computed from the same kept logits; otherwise none of that is built. Hidden states are kept only when a head asks for them
(``Needs``), for the Hugging Face ``hidden_states`` indices it declares (``Needs.layers``; seq2seq: the decoder's),
at the positions it reads: each context's last token, each candidate's last token, and the position that predicts
each scored token (``Needs.token_hidden``); so are the float32 logits at those positions (``Needs.token_logits``).

With a cache across calls (``kv_cache_mb``, :mod:`llmrl.engine.model.prefix_cache`) the prefix passes encode only
the tokens after each prefix's longest cached part (never its last token) and add what they encoded to the
cache. With frozen-trunk reuse (``trunk_reuse_mb``, :mod:`llmrl.engine.model.trunk`) every model call goes through
the trunk, told which tokens of which path each row computes: scoring records, the updater's passes replay.

The calls made are exactly those :mod:`llmrl.engine.model.batching` planned. The same code serves ``score``
(no grad) and the updater's forward (with grad). It knows nothing about processes or requests.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial

import torch

from llmrl.engine.model.batching import COMPLETION, BatchSpec, Needs, row_inputs
from llmrl.engine.model.hf_cache import cache_kwarg, cache_of
from llmrl.engine.model.pass_results import (
    BatchResult,
    Pick,
    TokenSink,
    at,
    at_least_float32,
    batch_result,
    prefix_outputs,
)
from llmrl.engine.model.tokenization import TokenPlan

# ----------------------------------------------------------------------------- running batches


def accepts_logits_to_keep(model) -> bool:
    """Whether the model can compute logits at chosen positions only (PEFT wrappers forward it on)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _select_cache_rows(cache, rows: torch.Tensor):
    """A copy of ``cache`` holding the given batch rows; the original is left untouched."""
    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    selected.batch_select_indices(rows)
    return selected


def pad_rows(seqs: list[list[int]], pad_id: int, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if not s:
            continue
        if left:
            ids[r, width - len(s):] = torch.tensor(s)
            mask[r, width - len(s):] = 1
        else:
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
    return ids.to(device), mask.to(device)



def run_batch(model, plan: TokenPlan, batch: BatchSpec, needs: Needs, pad_id: int, device,
              keep_logits: bool, decoder_start_id: int | None = None, kv_cache=None, trunk=None) -> BatchResult:
    """Run one planned batch (exactly ``batch.model_calls`` model calls). ``kv_cache`` (causal models, no-grad
    scoring only) is a :class:`~llmrl.engine.model.prefix_cache.CacheUse`: prefixes are read from and added to
    that cache across calls. ``trunk`` (causal models) is a :class:`~llmrl.engine.model.trunk.Trunk` in its
    recording or replaying mode."""
    if plan.kind == "seq2seq":
        from llmrl.engine.model.seq2seq_scoring import run_seq2seq  # (it reads this module's helpers)

        return run_seq2seq(model, plan, batch, needs, pad_id, device, decoder_start_id)
    return _run_causal(model, plan, batch, needs, pad_id, device, keep_logits, kv_cache, trunk)


def context_offsets(plan: TokenPlan, batch: BatchSpec) -> list[int]:
    offsets, total = [], 0
    for i in batch.contexts:
        offsets.append(total)
        total += len(plan.contexts[i].candidates)
    return offsets + [total]


def _run_causal(model, plan, batch, needs, pad_id, device, keep_logits, kv_cache=None, trunk=None) -> BatchResult:
    if kv_cache is not None and kv_cache.cache.stale_from is not None and trunk is not None:
        # After an update, cached prefixes keep their bottom layers: their top layers are recomputed from the trunk.
        kv_cache.cache.refresh(kv_cache.namespace, [plan.contexts[i].prefix for i in batch.contexts],
                               lambda paths: trunk.top_layers_kv(model, paths, keep_logits))
    if batch.packed:
        from llmrl.engine.model.packing import run_packed

        return run_packed(model, plan, batch, needs, pad_id, device, keep_logits, kv_cache, trunk)
    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = context_offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden, layers = needs.hidden, needs.layers
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    sink = TokenSink(needs)
    counts = torch.zeros(n_cand, dtype=torch.long)
    shared = torch.tensor([c.shared for c in ctxs], device=device)
    last_logits: list = [None] * len(ctxs)  # logits after each context's shared prefix
    last_hidden: list = [None] * len(ctxs)
    touched: list[torch.Tensor] = []  # every model call's output (see batch_result)
    call = _caller(model, plan, batch, needs, ctxs, trunk, replayable=kv_cache is None)
    encode = _encode_prefixes if kv_cache is None else partial(_encode_prefixes_with_cache, kv_cache=kv_cache)
    cache, prefix_mask = encode(call, ctxs, batch, needs, pad_id, device, keep_last, last_logits, last_hidden,
                                touched)

    context_hidden, candidate_hidden = prefix_outputs(ctxs, offsets, needs, sink, counts, last_logits, last_hidden,
                                                       device)

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
        # Positions whose logits some candidate scores, and (position, target) pairs per candidate.
        # (Position t predicts rest[t + 1], token number t + 1 - first_scored of the candidate's scored tokens.)
        needed: dict[tuple[int, int], int] = {}
        wanted: list[tuple[tuple[int, int], int, int, int]] = []
        for r, a, j in users.get(n, []):
            cand = ctxs[a].candidates[j]
            for t in range(max(cand.first_scored - 1, 0), len(cand.rest) - 1):
                needed.setdefault((r, t), 0)
                wanted.append(((r, t), cand.rest[t + 1], offsets[a] + j, t + 1 - cand.first_scored))
            counts[offsets[a] + j] += len(cand.rest) - max(cand.first_scored, 1)
        keep = torch.zeros((len(chunk), width), dtype=torch.bool)
        for r, t in needed:
            keep[r, t] = True
        flat = {rt: i for i, rt in enumerate(sorted(needed))}  # boolean selection is row-major
        keep = keep.to(device)
        kwargs = {"input_ids": ids, "position_ids": position, "output_hidden_states": want_hidden}
        if cache is not None:
            kwargs["cache"] = _select_cache_rows(cache, row_ctx)
            kwargs["attention_mask"] = torch.cat([prefix_mask[row_ctx], rest_mask], dim=1)
            kwargs["use_cache"] = True
        else:
            kwargs["attention_mask"] = rest_mask
            kwargs["use_cache"] = False
        if keep_logits:
            kwargs["logits_to_keep"] = keep
        out = call(_chunk_rows(ctxs, inputs, chunk), **kwargs)
        touched.append(out.logits)
        if wanted:
            logits = at_least_float32(out.logits if keep_logits else out.logits[keep])
            norm = torch.logsumexp(logits, dim=-1)
            index = torch.tensor([flat[w[0]] for w in wanted], device=device)
            targets = torch.tensor([w[1] for w in wanted], device=device)
            hidden = None
            if needs.token_hidden:  # position t predicts rest[t + 1]
                rows = torch.tensor([w[0][0] for w in wanted], device=device)
                cols = torch.tensor([w[0][1] for w in wanted], device=device)
                hidden = at(out.hidden_states, layers, rows, cols)
            sink.add(logits[index, targets] - norm[index], [w[2] for w in wanted],
                     [w[3] for w in wanted] if needs.per_token else None, targets, logits, norm, index, hidden)
        if want_hidden:
            for r, (a, k) in enumerate(chunk):
                if k == COMPLETION:
                    context_hidden[a] = Pick(out.hidden_states, (r, len(inputs[r]) - 1))
            if needs.candidate_hidden:
                for r, a, j in users.get(n, []):
                    last = len(row_inputs(plan, batch.contexts[a], j, needs)) - 1
                    candidate_hidden[offsets[a] + j] = Pick(out.hidden_states, (r, last))

    return batch_result(model, needs, sink, counts, context_hidden, candidate_hidden, device, touched)



def _encode_prefixes(call, ctxs, batch, needs, pad_id, device, keep_last, last_logits, last_hidden, touched):
    """The prefix passes: the prefix all contexts share, then each context's own part. Fills ``last_logits`` /
    ``last_hidden`` (after each context's prefix) and ``touched``; returns the cache and its attention mask."""
    want_hidden = needs.hidden
    cache = prefix_mask = None
    # The prefix every context of the batch shares (an instruction, a system prompt) is encoded once.
    common = batch.common
    if common > 0:
        out = call(_common_rows(ctxs, common), input_ids=torch.tensor([ctxs[0].prefix[:common]], device=device),
                   use_cache=True, output_hidden_states=want_hidden, **keep_last)
        touched.append(out.logits)
        cache = _select_cache_rows(cache_of(out), torch.zeros(len(ctxs), dtype=torch.long, device=device))
        prefix_mask = torch.ones((len(ctxs), common), dtype=torch.long, device=device)
        for a, c in enumerate(ctxs):
            if c.shared == common:
                last_logits[a] = Pick(out.logits, (0, -1))
                last_hidden[a] = Pick(out.hidden_states, (0, -1)) if want_hidden else None
    # Then each context's own part of its prefix, left padded after the common part, with explicit positions.
    remainders = [c.prefix[common:] for c in ctxs]
    if batch.own_prefixes:
        ids, own_mask = pad_rows(remainders, pad_id, left=True, device=device)
        position = common + (own_mask.cumsum(-1) - 1).clamp(min=0)
        mask = own_mask if prefix_mask is None else torch.cat([prefix_mask, own_mask], dim=1)
        out = call(_own_rows(ctxs, [common] * len(ctxs), remainders, ids.shape[1]), input_ids=ids,
                   attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                   output_hidden_states=want_hidden, **keep_last)
        touched.append(out.logits)
        cache, prefix_mask = cache_of(out), mask
        for a, rest in enumerate(remainders):
            if rest:
                last_logits[a] = Pick(out.logits, (a, -1))
                last_hidden[a] = Pick(out.hidden_states, (a, -1)) if want_hidden else None

    return cache, prefix_mask


def _encode_prefixes_with_cache(call, ctxs, batch, needs, pad_id, device, keep_last, last_logits, last_hidden,
                                touched, *, kv_cache):
    """:func:`_encode_prefixes` through a cache that lives across calls (``kv_cache``: a
    :class:`~llmrl.engine.model.prefix_cache.CacheUse`): each pass encodes only the tokens after the longest
    cached prefix (never the last one, so the same calls run with or without hits), then caches what it
    encoded. Rows whose cached parts differ in length are left padded, with explicit positions."""
    store, space = kv_cache.cache, kv_cache.namespace
    want_hidden = needs.hidden
    n = len(ctxs)
    common = batch.common
    common_kv = None
    if common > 0:
        head = ctxs[0].prefix[:common]
        hit, pieces = store.match_pieces(space, head, limit=common - 1)
        out = call([(0, head, hit, list(range(common - hit)))], input_ids=torch.tensor([head[hit:]], device=device),
                   position_ids=torch.arange(hit, common, device=device)[None],
                   cache=_cache_of([pieces], [hit], device) if hit else None, use_cache=True,
                   output_hidden_states=want_hidden, **keep_last)
        touched.append(out.logits)
        common_kv = [(layer.keys[0], layer.values[0]) for layer in cache_of(out).layers]
        store.insert(space, head, lambda i, j: [(k[:, i:j], v[:, i:j]) for k, v in common_kv])
        for a, c in enumerate(ctxs):
            if c.shared == common:
                last_logits[a] = Pick(out.logits, (0, -1))
                last_hidden[a] = Pick(out.hidden_states, (0, -1)) if want_hidden else None
        if not batch.own_prefixes:
            cache = _cache_of([[common_kv]] * n, [common] * n, device)
            return cache, torch.ones((n, common), dtype=torch.long, device=device)
    if not batch.own_prefixes:
        return None, None
    starts, kvs = [], []
    for c in ctxs:
        prefix = c.prefix
        if len(prefix) <= common:  # nothing of its own after the common part (or no prefix at all)
            starts.append(len(prefix))
            kvs.append([common_kv] if prefix else [])
            continue
        hit, pieces = store.match_pieces(space, prefix, limit=len(prefix) - 1)
        if hit < common:  # the common part was just encoded (and may have been evicted since)
            hit, pieces = common, [common_kv]
        starts.append(hit)
        kvs.append(pieces)
    width = max(starts)
    remainders = [c.prefix[start:] for c, start in zip(ctxs, starts)]
    ids, own_mask = pad_rows(remainders, pad_id, left=True, device=device)
    past_mask = torch.zeros((n, width), dtype=torch.long, device=device)
    for a, start in enumerate(starts):
        past_mask[a, width - start:] = 1
    start_of = torch.tensor(starts, device=device)[:, None]
    position = start_of + (own_mask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([past_mask, own_mask], dim=1)
    out = call(_own_rows(ctxs, starts, remainders, ids.shape[1]), input_ids=ids, attention_mask=mask,
               position_ids=position, cache=_cache_of(kvs, starts, device) if width else None,
               use_cache=True, output_hidden_states=want_hidden, **keep_last)
    touched.append(out.logits)
    cache = cache_of(out)
    for a, rest in enumerate(remainders):
        if rest:
            last_logits[a] = Pick(out.logits, (a, -1))
            last_hidden[a] = Pick(out.hidden_states, (a, -1)) if want_hidden else None
    own_width = ids.shape[1]
    for a, c in enumerate(ctxs):
        if remainders[a]:
            # This row's tokens, in order: its cached part (ending at column ``width``), then its own part (ending
            # at the last column): two contiguous runs of columns, read as views wherever a request fits in one.
            end_own, start, rest = width + own_width, starts[a], len(remainders[a])

            def column_of(t, start=start, end_own=end_own, rest=rest):
                return width - start + t if t < start else end_own - rest + (t - start)

            def kv_of(i, j, a=a, start=start, column_of=column_of):
                if i >= start or j <= start:  # one run
                    lo = column_of(i)
                    return [(layer.keys[a][:, lo:lo + j - i], layer.values[a][:, lo:lo + j - i])
                            for layer in cache.layers]
                columns = torch.tensor([column_of(t) for t in range(i, j)], device=device)
                return [(layer.keys[a][:, columns], layer.values[a][:, columns]) for layer in cache.layers]

            store.insert(space, c.prefix, kv_of)
    return cache, mask


# ----------------------------------------------------------------------------- which tokens each call computes

def _common_rows(ctxs, common: int) -> list[tuple]:
    return [(0, ctxs[0].prefix[:common], 0, list(range(common)))]


def _own_rows(ctxs, starts: list[int], remainders: list[list[int]], width: int) -> list[tuple]:
    """Rows of a left padded pass over each context's prefix after ``starts[a]`` tokens."""
    return [(a, c.prefix, start, list(range(width - len(rest), width)) if rest else [])
            for a, (c, start, rest) in enumerate(zip(ctxs, starts, remainders))]


def _chunk_rows(ctxs, inputs: list[list[int]], chunk) -> list[tuple]:
    """Rows of a candidate pass (right padded, after each context's prefix)."""
    return [(r, ctxs[a].prefix + inputs[r], len(ctxs[a].prefix), list(range(len(inputs[r]))))
            for r, (a, _) in enumerate(chunk)]


def _caller(model, plan, batch, needs, ctxs, trunk, replayable: bool):
    """``call(rows, **kwargs)``: the model call, through the trunk when there is one (see
    :mod:`llmrl.engine.model.trunk`). A batch is replayed whole when the trunk holds every token it computes."""
    def calls():
        common = batch.common
        rows = [_common_rows(ctxs, common)] if common > 0 else []
        if batch.own_prefixes:
            remainders = [c.prefix[common:] for c in ctxs]
            rows.append(_own_rows(ctxs, [common] * len(ctxs), remainders, max(len(r) for r in remainders)))
        for chunk in batch.chunks:
            rows.append(_chunk_rows(ctxs, [row_inputs(plan, batch.contexts[a], k, needs) for a, k in chunk], chunk))
        return rows

    return make_caller(model, needs, trunk, replayable, calls)


def make_caller(model, needs, trunk, replayable: bool, calls):
    """``call(rows, **kwargs)``: the model call, through the trunk when there is one. ``calls()`` lists the rows
    of every call the batch will make: it is replayed whole when the trunk holds every token they compute. A
    key/value cache given as ``cache`` reaches the model under the name its ``forward`` takes
    (:func:`~llmrl.engine.model.hf_cache.cache_kwarg`)."""
    name = cache_kwarg(model)

    def named(kwargs: dict) -> dict:
        if name != "cache" and "cache" in kwargs:
            kwargs[name] = kwargs.pop("cache")
        return kwargs

    if trunk is None:
        return lambda rows, **kwargs: model(**named(kwargs))
    replay = (trunk.mode == "replay" and replayable and not (needs.hidden and trunk.reads_bottom(needs.layers))
              and trunk.available(calls()))
    return lambda rows, **kwargs: trunk.call(model, named(kwargs), rows, replay)


def _cache_of(rows: list[list], lengths: list[int], device):
    """A Hugging Face cache whose row ``a`` holds the first ``lengths[a]`` tokens of ``rows[a]``: pieces (per layer,
    keys and values ``[kv_heads, tokens, head_dim]``) laid end to end, left padded to the longest row."""
    from transformers import DynamicCache

    width = max(lengths)
    sample = next(r[0] for r in rows if r)
    layers = []
    for layer, (k0, v0) in enumerate(sample):
        keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(rows), v0.shape[0], width, v0.shape[2]))
        for a, (pieces, length) in enumerate(zip(rows, lengths)):
            at = width - length
            for piece in pieces:
                take = min(piece[layer][0].shape[1], width - at)
                if take <= 0:
                    break
                keys[a, :, at:at + take] = piece[layer][0][:, :take]
                values[a, :, at:at + take] = piece[layer][1][:, :take]
                at += take
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


