"""Run planned batches of a scoring request through the model: log-probs of candidates, hidden states for heads.

For a causal model a batch runs one pass over the prefix all its contexts share (if any), one over each
context's own part of its shared prefix (left padded, explicit position ids), both keeping their key/value
cache, then *candidate passes* over chunks of candidate rows that attend to that cache, so each context is
encoded once whatever the number of its candidates. A one-token candidate needs no candidate pass at all:
the prefix pass's last logits score it. Logits are computed only at the positions that are scored
(``logits_to_keep``), in float32, and reduced to log-probs without materialising a full log-softmax.

For a seq2seq model the encoder runs once per batch (when the plan says so) and its output is reused by the
decoder rows of every candidate.

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
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from llmrl.engine.model.batching import COMPLETION, BatchSpec, Needs, row_inputs
from llmrl.engine.model.hf_cache import cache_kwarg, cache_of
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


def _pad(seqs: list[list[int]], pad_id: int, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
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


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or in its own dtype when that is wider (a float64 model keeps its precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = at_least_float32(logits)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _entropy(logits: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy (nats) of each row's softmax, in float32 (or wider); 0 log 0 counts 0 (and has a zero gradient)."""
    logits = at_least_float32(logits)
    logp = logits - (torch.logsumexp(logits, dim=-1) if norm is None else norm)[:, None]
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


@dataclass
class Tokens:
    """Per-token outputs of one batch, in no particular order: candidate (batch-local index) and position within
    its scored tokens say where each belongs."""

    logprobs: torch.Tensor  # [n_tokens] (on the model's device; differentiable)
    candidate: torch.Tensor  # [n_tokens] long, CPU
    position: torch.Tensor  # [n_tokens] long, CPU
    ids: torch.Tensor  # [n_tokens] long, CPU: the scored token ids
    entropy: torch.Tensor | None  # [n_tokens] when asked
    hidden: dict[int, torch.Tensor] | None = None  # layer -> [n_tokens, H] with Needs.token_hidden
    logits: torch.Tensor | None = None  # [n_tokens, vocab] float32 with Needs.token_logits


class _TokenSink:
    """Collects scored tokens as a batch runs: log-probs and candidates always (for the sums), the rest only when
    the request asks for per-token outputs."""

    def __init__(self, needs: Needs):
        self.needs = needs
        self.lp: list[torch.Tensor] = []
        self.cand: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []
        self.ent: list[torch.Tensor] = []
        self.hidden: list[dict[int, torch.Tensor]] = []
        self.logits: list[torch.Tensor] = []

    def add(self, logprobs, candidates: list[int], positions: list[int] | None, targets: torch.Tensor, logits=None,
            norm=None, index=None, hidden=None) -> None:
        """``positions`` (a list, or None when per-token outputs are not kept) are the tokens' places in their
        candidates; entropies and kept logits come from ``logits`` (rows selected by ``index``, if given);
        ``hidden`` (layer -> ``[n, H]``, with ``Needs.token_hidden``) holds the tokens' hidden states."""
        self.lp.append(logprobs)
        self.cand.append(torch.tensor(candidates))
        if not self.needs.per_token:
            return
        self.pos.append(torch.tensor(positions, dtype=torch.long))
        self.ids.append(targets.cpu())
        if self.needs.entropy:
            entropy = _entropy(logits, norm)
            self.ent.append(entropy if index is None else entropy[index])
        if self.needs.token_logits:
            self.logits.append(at_least_float32(logits if index is None else logits[index]))
        if self.needs.token_hidden:
            self.hidden.append(hidden)


@dataclass
class BatchResult:
    """Per-candidate scores of one batch (candidates in context order) and optional hidden states and tokens."""

    scores: torch.Tensor  # [n_candidates] sum of token log-probs
    counts: torch.Tensor  # [n_candidates] number of scored tokens
    context_hidden: dict[int, torch.Tensor] | None  # layer -> [n_contexts, H]
    candidate_hidden: dict[int, torch.Tensor] | None  # layer -> [n_candidates, H]
    tokens: Tokens | None = None  # with Needs.per_token


def run_batch(model, plan: TokenPlan, batch: BatchSpec, needs: Needs, pad_id: int, device,
              keep_logits: bool, decoder_start_id: int | None = None, kv_cache=None, trunk=None) -> BatchResult:
    """Run one planned batch (exactly ``batch.model_calls`` model calls). ``kv_cache`` (causal models, no-grad
    scoring only) is a :class:`~llmrl.engine.model.prefix_cache.CacheUse`: prefixes are read from and added to
    that cache across calls. ``trunk`` (causal models) is a :class:`~llmrl.engine.model.trunk.Trunk` in its
    recording or replaying mode."""
    if plan.kind == "seq2seq":
        return _run_seq2seq(model, plan, batch, needs, pad_id, device, decoder_start_id)
    return _run_causal(model, plan, batch, needs, pad_id, device, keep_logits, kv_cache, trunk)


def _offsets(plan: TokenPlan, batch: BatchSpec) -> list[int]:
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
    offsets = _offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden, layers = needs.hidden, needs.layers
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    sink = _TokenSink(needs)
    counts = torch.zeros(n_cand, dtype=torch.long)
    shared = torch.tensor([c.shared for c in ctxs], device=device)
    last_logits: list = [None] * len(ctxs)  # logits after each context's shared prefix
    last_hidden: list = [None] * len(ctxs)
    touched: list[torch.Tensor] = []  # every model call's output (see _batch_result)
    call = _caller(model, plan, batch, needs, ctxs, trunk, replayable=kv_cache is None)
    encode = _encode_prefixes if kv_cache is None else partial(_encode_prefixes_with_cache, kv_cache=kv_cache)
    cache, prefix_mask = encode(call, ctxs, batch, needs, pad_id, device, keep_last, last_logits, last_hidden,
                                touched)

    context_hidden, candidate_hidden = _prefix_outputs(ctxs, offsets, needs, sink, counts, last_logits, last_hidden,
                                                       device)

    row_of = {(a, k): (n, r) for n, chunk in enumerate(batch.chunks) for r, (a, k) in enumerate(chunk)}
    users: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (row, context position, candidate)
    for (a, j), k in batch.cover.items():
        n, r = row_of[a, k]
        users.setdefault(n, []).append((r, a, j))
    for n, chunk in enumerate(batch.chunks):
        inputs = [row_inputs(plan, batch.contexts[a], k, needs) for a, k in chunk]
        ids, rest_mask = _pad(inputs, pad_id, left=False, device=device)
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
                hidden = _at(out.hidden_states, layers, rows, cols)
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

    return _batch_result(model, needs, sink, counts, context_hidden, candidate_hidden, device, touched)



def _prefix_outputs(ctxs, offsets, needs, sink, counts, last_logits, last_hidden, device):
    """What the prefix passes alone give: the first scored token of candidates that start right after the shared
    prefix (scored from the prefix's last logits), and hidden states at the prefix's end. Returns per-context and
    per-candidate lists of hidden states, to be completed by the candidate passes."""
    layers, want_hidden, n_cand = needs.layers, needs.hidden, offsets[-1]
    # Candidates whose first scored token directly follows the shared prefix.
    firsts = [(a, j) for a, c in enumerate(ctxs) for j, cand in enumerate(c.candidates)
              if cand.first_scored == 0 and cand.rest]
    if firsts:
        logits = take([last_logits[a] for a, _ in firsts])
        targets = torch.tensor([ctxs[a].candidates[j].rest[0] for a, j in firsts], device=device)
        hidden = (take_layers([last_hidden[a] for a, _ in firsts], layers)
                  if needs.token_hidden else None)  # the prefix's last position predicts these tokens
        sink.add(_token_logprobs(logits, targets), [offsets[a] + j for a, j in firsts], [0] * len(firsts), targets,
                 logits, hidden=hidden)
        for a, j in firsts:
            counts[offsets[a] + j] += 1

    context_hidden: list = [None] * len(ctxs)
    candidate_hidden: list = [None] * n_cand
    if want_hidden:
        for a, c in enumerate(ctxs):
            if c.shared == len(c.ids) and c.shared > 0:
                context_hidden[a] = last_hidden[a]
            for j, cand in enumerate(c.candidates):
                if not cand.rest and c.shared > 0:
                    candidate_hidden[offsets[a] + j] = last_hidden[a]
    return context_hidden, candidate_hidden


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
        ids, own_mask = _pad(remainders, pad_id, left=True, device=device)
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
    ids, own_mask = _pad(remainders, pad_id, left=True, device=device)
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


def _batch_result(model, needs, sink: _TokenSink, counts, context_hidden, candidate_hidden, device,
                  touched: list[torch.Tensor]) -> BatchResult:
    values = torch.cat(sink.lp) if sink.lp else torch.zeros(0, device=device)
    index = torch.cat(sink.cand) if sink.cand else torch.zeros(0, dtype=torch.long)
    scores = torch.zeros(len(counts), device=values.device, dtype=values.dtype).index_add(0, index.to(values.device),
                                                                                          values)
    tokens = None
    if needs.per_token:
        width, vocab = _hidden_size(model), model.config.get_text_config().vocab_size
        tokens = Tokens(values, index, _cat_long(sink.pos), _cat_long(sink.ids),
                        (torch.cat(sink.ent) if sink.ent else torch.zeros(0, device=device)) if needs.entropy else None,
                        _cat_layers(sink.hidden, needs.layers, width, device) if needs.token_hidden else None,
                        (torch.cat(sink.logits) if sink.logits else torch.zeros((0, vocab), device=device))
                        if needs.token_logits else None)
    context_hidden = (take_layers(context_hidden, needs.layers, _hidden_size(model), device)
                      if needs.context_hidden else None)
    candidate_hidden = (take_layers(candidate_hidden, needs.layers, _hidden_size(model), device)
                        if needs.candidate_hidden else None)
    if torch.is_grad_enabled() and touched:
        # Every model call reaches the loss (with weight zero), so a backward pass visits every layer of every call
        # whatever the loss reads: under ZeRO-3 each replica gathers the same weights in the same order.
        zero = 0.0 * sum(t.float().sum() for t in touched)
        scores = scores + zero
        if tokens is not None:
            tokens.logprobs = tokens.logprobs + zero
            tokens.entropy = None if tokens.entropy is None else tokens.entropy + zero
            tokens.logits = None if tokens.logits is None else tokens.logits + zero
            tokens.hidden = None if tokens.hidden is None else {k: v + zero for k, v in tokens.hidden.items()}
        context_hidden = None if context_hidden is None else {k: v + zero for k, v in context_hidden.items()}
        candidate_hidden = None if candidate_hidden is None else {k: v + zero for k, v in candidate_hidden.items()}
    return BatchResult(scores=scores, counts=counts, context_hidden=context_hidden, candidate_hidden=candidate_hidden,
                       tokens=tokens)


class Pick(NamedTuple):
    """Row ``index`` of ``source`` (a tensor, or Hugging Face's tuple of hidden states, one tensor per layer),
    taken later by :func:`take` together with the other picks: one gather per source tensor. (Indexing one row at a
    time would cost, in backward, a zero tensor of the source's whole size per row: for the logits of a batch, a
    few hundred thousand floats per context.)"""

    source: object
    index: tuple[int, ...]


def take(picks: list[Pick], layer: int | None = None) -> torch.Tensor:
    """``torch.stack([p.source[p.index] for p in picks])`` (``p.source[layer]`` for hidden states), with one
    indexing per distinct source."""
    groups: dict[int, list[int]] = {}
    for k, pick in enumerate(picks):
        groups.setdefault(id(pick.source), []).append(k)
    parts, order = [], []
    for ks in groups.values():
        source = picks[ks[0]].source if layer is None else picks[ks[0]].source[layer]
        columns = zip(*(picks[k].index for k in ks))
        parts.append(source[tuple(torch.tensor(c, device=source.device) for c in columns)])
        order += ks
    if len(parts) == 1 and order == list(range(len(order))):
        return parts[0]
    where = torch.empty(len(order), dtype=torch.long)
    where[torch.tensor(order)] = torch.arange(len(order))
    joined = torch.cat(parts)
    return joined[where.to(joined.device)]


def take_layers(picks: list[Pick], layers, width: int = 0, device=None) -> dict[int, torch.Tensor]:
    """Per layer, the picked hidden states stacked in order (``[0, width]`` when there is none)."""
    if not picks:
        return {layer: torch.zeros((0, width), device=device) for layer in layers}
    return {layer: take(picks, layer) for layer in layers}


def _at(hidden_states, layers, rows, cols) -> dict[int, torch.Tensor]:
    """The hidden states of ``layers`` (indices into Hugging Face's ``hidden_states``) at ``[rows, cols]``."""
    return {layer: hidden_states[layer][rows, cols] for layer in layers}


def _cat_layers(items: list[dict], layers, width: int, device) -> dict[int, torch.Tensor]:
    """Per layer, the items' hidden states concatenated in order; ``[0, width]`` when none."""
    return {layer: torch.cat([d[layer] for d in items]) if items else torch.zeros((0, width), device=device)
            for layer in layers}


def _cat_long(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _hidden_size(model) -> int:
    return model.config.get_text_config().hidden_size


def _run_seq2seq(model, plan, batch, needs, pad_id, device, start_id) -> BatchResult:
    from transformers.modeling_outputs import BaseModelOutput

    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = _offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden, layers = needs.hidden, needs.layers
    enc_ids, enc_mask = _pad([c.ids for c in ctxs], pad_id, left=False, device=device)
    encoded = model.get_encoder()(input_ids=enc_ids, attention_mask=enc_mask, return_dict=True) if batch.encoder_pass else None
    touched = [] if encoded is None else [encoded.last_hidden_state]
    sink = _TokenSink(needs)
    counts = torch.zeros(n_cand, dtype=torch.long)
    context_hidden = [None] * len(ctxs)
    candidate_hidden = [None] * n_cand
    for chunk in batch.chunks:
        inputs = [[start_id] + row_inputs(plan, batch.contexts[a], j, needs) for a, j in chunk]
        dec_ids, dec_mask = _pad(inputs, pad_id, left=False, device=device)
        row_ctx = torch.tensor([a for a, _ in chunk], device=device)
        kwargs = {"attention_mask": enc_mask[row_ctx], "decoder_input_ids": dec_ids,
                  "decoder_attention_mask": dec_mask, "output_hidden_states": want_hidden, "use_cache": False}
        if encoded is not None:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoded.last_hidden_state[row_ctx])
        else:
            kwargs["input_ids"] = enc_ids[row_ctx]
        out = model(**kwargs)
        touched.append(out.logits)
        rows, positions, targets, cand_of_token = [], [], [], []
        for r, (a, j) in enumerate(chunk):
            if j == COMPLETION:
                continue
            rest = ctxs[a].candidates[j].rest
            for t in range(len(rest)):
                rows.append(r)
                positions.append(t)
                targets.append(rest[t])
                cand_of_token.append(offsets[a] + j)
            counts[offsets[a] + j] += len(rest)
        if targets:
            logits = out.logits[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]
            targets = torch.tensor(targets, device=device)
            # Decoder position t (reading the start token and rest[:t]) predicts rest[t].
            hidden = (_at(out.decoder_hidden_states, layers, torch.tensor(rows, device=device),
                          torch.tensor(positions, device=device)) if needs.token_hidden else None)
            sink.add(_token_logprobs(logits, targets), cand_of_token, positions, targets, logits, hidden=hidden)
        if want_hidden:
            hidden = out.decoder_hidden_states
            for r, (a, j) in enumerate(chunk):
                if context_hidden[a] is None:
                    context_hidden[a] = Pick(hidden, (r, 0))  # the decoder start position has read the context
                if j != COMPLETION and needs.candidate_hidden:
                    candidate_hidden[offsets[a] + j] = Pick(hidden, (r, len(inputs[r]) - 1))
    return _batch_result(model, needs, sink, counts, context_hidden, candidate_hidden, device, touched)
