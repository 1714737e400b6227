"""Batched forward passes that score candidates, with prefix reuse and a token budget.

For a causal model a batch runs one *prefix pass* over its contexts' shared prefixes (left padded,
explicit position ids) that keeps their key/value cache, then *candidate passes* over chunks of
candidate rows that attend to that cache, so each context is encoded once whatever the number of
its candidates. A candidate row feeds only the tokens that predict a scored token (its last token
is a target, never an input), and a one-token candidate needs no candidate pass at all: the prefix
pass's last logits score it. Logits are computed only at the positions that are scored
(``logits_to_keep``), in float32, and reduced to log-probs without materialising a full log-softmax.

For a seq2seq model the encoder runs once per context and its output is reused by the decoder
rows of every candidate.

Batches are formed by a token budget (padded tokens, cache included) and a row cap, not a fixed
row count, so memory stays bounded with long contexts. The same code serves ``score`` (no grad)
and the updater's forward (with grad). It knows nothing about processes or requests.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch

from llmrl.engine.tokenization import TokenPlan

COMPLETION = -1  # row index of a context's completion row (the hidden state of its last token)


@dataclass(frozen=True)
class Needs:
    """What the heads of a request need besides scores."""

    context_hidden: bool = False  # hidden state at each context's last token
    candidate_hidden: bool = False  # hidden state at each candidate's last token


@dataclass
class BatchSpec:
    contexts: list[int]  # indices into the plan's contexts
    chunks: list[list[tuple[int, int]]] = field(default_factory=list)  # rows: (position in contexts, candidate or COMPLETION)
    # Causal models: candidate (a, j) reads its logits from the row of candidate (a, cover[a, j]), whose inputs
    # start with its own (" turn left" and " turn right" both need only " turn": one row serves both).
    cover: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(len(c) for c in self.chunks)


def _row_inputs(plan: TokenPlan, ctx_index: int, cand: int, needs: Needs) -> list[int]:
    """Tokens a row feeds to the model after the shared prefix (causal) or after the start token (seq2seq)."""
    ctx = plan.contexts[ctx_index]
    if plan.kind == "seq2seq":
        if cand == COMPLETION:
            return []
        rest = ctx.candidates[cand].rest
        return rest if needs.candidate_hidden else rest[:-1]
    if cand == COMPLETION:
        return ctx.ids[ctx.shared:]
    rest = ctx.candidates[cand].rest
    return rest if needs.candidate_hidden else rest[:-1]


def _needs_row(plan: TokenPlan, ctx_index: int, cand: int, needs: Needs) -> bool:
    """Whether a candidate needs a row in a candidate pass (completion rows are decided by the caller)."""
    ctx = plan.contexts[ctx_index]
    candidate = ctx.candidates[cand]
    if plan.kind == "seq2seq":
        return len(candidate.rest) > 0 or needs.candidate_hidden
    scored_in_row = len(candidate.rest) - max(candidate.first_scored, 1) > 0
    hidden_in_row = needs.candidate_hidden and (len(candidate.rest) > 0 or ctx.shared == 0)
    return (scored_in_row or hidden_in_row) and len(_row_inputs(plan, ctx_index, cand, needs)) > 0


def plan_batches(plan: TokenPlan, token_budget: int, max_rows: int, needs: Needs) -> list[BatchSpec]:
    """Group contexts into batches and their candidate rows into chunks within the budget."""
    order = sorted(range(len(plan.contexts)), key=lambda i: -_prefix_len(plan, i))
    batches: list[BatchSpec] = []
    current: list[int] = []
    widest = 0
    for i in order:
        width = max(widest, _prefix_len(plan, i), 1)
        if current and ((len(current) + 1) * width > token_budget or len(current) + 1 > max_rows):
            batches.append(BatchSpec(current))
            current, width = [], max(_prefix_len(plan, i), 1)
        current.append(i)
        widest = width
    if current:
        batches.append(BatchSpec(current))
    for batch in batches:
        batch.chunks = _chunk_rows(plan, batch, token_budget, max_rows, needs)
    return batches


def _cover_rows(plan: TokenPlan, i: int, a: int, wanted: list[int], needs: Needs, cover: dict) -> list[int]:
    """Candidates whose rows are computed; fills ``cover`` for every wanted candidate. A candidate whose
    inputs are a prefix of another's reads that row: causal attention makes the shared positions identical."""
    inputs = {j: _row_inputs(plan, i, j, needs) for j in wanted}
    kept: list[int] = []
    for j in sorted(wanted, key=lambda j: -len(inputs[j])):
        mine = inputs[j]
        host = next((k for k in kept if inputs[k][: len(mine)] == mine), None)
        if host is None:
            kept.append(j)
            host = j
        cover[a, j] = host
    return sorted(kept)


def _prefix_len(plan: TokenPlan, i: int) -> int:
    ctx = plan.contexts[i]
    return len(ctx.ids) if plan.kind == "seq2seq" else ctx.shared


def _chunk_rows(plan: TokenPlan, batch: BatchSpec, budget: int, max_rows: int, needs: Needs):
    rows = []
    for a, i in enumerate(batch.contexts):
        ctx = plan.contexts[i]
        wanted = [j for j in range(len(ctx.candidates)) if _needs_row(plan, i, j, needs)]
        if plan.kind == "causal":
            rows += [(a, k) for k in _cover_rows(plan, i, a, wanted, needs, batch.cover)]
        else:
            rows += [(a, j) for j in wanted]
        if needs.context_hidden and (plan.kind == "seq2seq" or ctx.shared < len(ctx.ids)):
            rows.append((a, COMPLETION))
    prefix = max((_prefix_len(plan, i) for i in batch.contexts), default=0)
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    longest = 0
    for a, j in rows:
        length = len(_row_inputs(plan, batch.contexts[a], j, needs)) + (1 if plan.kind == "seq2seq" else 0)
        longest_if = max(longest, length, 1)
        if current and ((len(current) + 1) * (prefix + longest_if) > budget or len(current) + 1 > max_rows):
            chunks.append(current)
            current, longest_if = [], max(length, 1)
        current.append((a, j))
        longest = longest_if
    if current:
        chunks.append(current)
    return chunks


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


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@dataclass
class BatchResult:
    """Per-candidate scores of one batch (candidates in context order) and optional hidden states."""

    scores: torch.Tensor  # [n_candidates] sum of token log-probs
    counts: torch.Tensor  # [n_candidates] number of scored tokens
    context_hidden: torch.Tensor | None  # [n_contexts, H]
    candidate_hidden: torch.Tensor | None  # [n_candidates, H]


def run_batch(model, plan: TokenPlan, batch: BatchSpec, needs: Needs, pad_id: int, device,
              keep_logits: bool, decoder_start_id: int | None = None, prefix_reuse: bool = True) -> BatchResult:
    if plan.kind == "seq2seq":
        return _run_seq2seq(model, plan, batch, needs, pad_id, device, decoder_start_id, prefix_reuse)
    return _run_causal(model, plan, batch, needs, pad_id, device, keep_logits)


def _offsets(plan: TokenPlan, batch: BatchSpec) -> list[int]:
    offsets, total = [], 0
    for i in batch.contexts:
        offsets.append(total)
        total += len(plan.contexts[i].candidates)
    return offsets + [total]


def common_prefix_of(seqs: list[list[int]]) -> int:
    """Length of the prefix shared by every sequence (0 for fewer than two)."""
    if len(seqs) < 2:
        return 0
    first, n = seqs[0], min(len(q) for q in seqs)
    i = 0
    while i < n and all(q[i] == first[i] for q in seqs):
        i += 1
    return i


def causal_calls(plan: TokenPlan, batch: BatchSpec) -> int:
    """How many model calls :func:`run_batch` makes for a causal batch (ranks in lockstep must agree)."""
    prefixes = [plan.contexts[i].prefix for i in batch.contexts]
    common = common_prefix_of(prefixes)
    return int(common > 0) + int(max((len(p) - common for p in prefixes), default=0) > 0) + len(batch.chunks)


def _run_causal(model, plan, batch, needs, pad_id, device, keep_logits) -> BatchResult:
    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = _offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden = needs.context_hidden or needs.candidate_hidden
    keep_last = {"logits_to_keep": 1} if keep_logits else {}
    token_lp: list[torch.Tensor] = []
    token_cand: list[torch.Tensor] = []
    counts = torch.zeros(n_cand, dtype=torch.long)
    shared = torch.tensor([c.shared for c in ctxs], device=device)
    last_logits: list = [None] * len(ctxs)  # logits after each context's shared prefix
    last_hidden: list = [None] * len(ctxs)
    cache = prefix_mask = None

    # The prefix every context of the batch shares (an instruction, a system prompt) is encoded once.
    common = common_prefix_of([c.prefix for c in ctxs])
    if common > 0:
        out = model(input_ids=torch.tensor([ctxs[0].prefix[:common]], device=device), use_cache=True,
                    output_hidden_states=want_hidden, **keep_last)
        cache = _select_cache_rows(out.past_key_values, torch.zeros(len(ctxs), dtype=torch.long, device=device))
        prefix_mask = torch.ones((len(ctxs), common), dtype=torch.long, device=device)
        for a, c in enumerate(ctxs):
            if c.shared == common:
                last_logits[a] = out.logits[0, -1]
                last_hidden[a] = out.hidden_states[-1][0, -1] if want_hidden else None
    # Then each context's own part of its prefix, left padded after the common part, with explicit positions.
    remainders = [c.prefix[common:] for c in ctxs]
    if max(len(r) for r in remainders) > 0:
        ids, own_mask = _pad(remainders, pad_id, left=True, device=device)
        position = common + (own_mask.cumsum(-1) - 1).clamp(min=0)
        mask = own_mask if prefix_mask is None else torch.cat([prefix_mask, own_mask], dim=1)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True,
                    output_hidden_states=want_hidden, **keep_last)
        cache, prefix_mask = out.past_key_values, mask
        for a, rest in enumerate(remainders):
            if rest:
                last_logits[a] = out.logits[a, -1]
                last_hidden[a] = out.hidden_states[-1][a, -1] if want_hidden else None

    # Candidates whose first scored token directly follows the shared prefix.
    firsts = [(a, j) for a, c in enumerate(ctxs) for j, cand in enumerate(c.candidates)
              if cand.first_scored == 0 and cand.rest]
    if firsts:
        logits = torch.stack([last_logits[a] for a, _ in firsts])
        targets = torch.tensor([ctxs[a].candidates[j].rest[0] for a, j in firsts], device=device)
        token_lp.append(_token_logprobs(logits, targets))
        token_cand.append(torch.tensor([offsets[a] + j for a, j in firsts]))
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

    row_of = {(a, k): (n, r) for n, chunk in enumerate(batch.chunks) for r, (a, k) in enumerate(chunk)}
    users: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (row, context position, candidate)
    for (a, j), k in batch.cover.items():
        n, r = row_of[a, k]
        users.setdefault(n, []).append((r, a, j))
    for n, chunk in enumerate(batch.chunks):
        inputs = [_row_inputs(plan, batch.contexts[a], k, needs) for a, k in chunk]
        ids, rest_mask = _pad(inputs, pad_id, left=False, device=device)
        row_ctx = torch.tensor([a for a, _ in chunk], device=device)
        width = ids.shape[1]
        position = shared[row_ctx][:, None] + torch.arange(width, device=device)[None, :]
        # Positions whose logits some candidate scores, and (position, target) pairs per candidate.
        needed: dict[tuple[int, int], int] = {}
        wanted: list[tuple[tuple[int, int], int, int]] = []
        for r, a, j in users.get(n, []):
            cand = ctxs[a].candidates[j]
            for t in range(max(cand.first_scored - 1, 0), len(cand.rest) - 1):
                needed.setdefault((r, t), 0)
                wanted.append(((r, t), cand.rest[t + 1], offsets[a] + j))
            counts[offsets[a] + j] += len(cand.rest) - max(cand.first_scored, 1)
        keep = torch.zeros((len(chunk), width), dtype=torch.bool)
        for r, t in needed:
            keep[r, t] = True
        flat = {rt: i for i, rt in enumerate(sorted(needed))}  # boolean selection is row-major
        keep = keep.to(device)
        kwargs = {"input_ids": ids, "position_ids": position, "output_hidden_states": want_hidden}
        if cache is not None:
            kwargs["past_key_values"] = _select_cache_rows(cache, row_ctx)
            kwargs["attention_mask"] = torch.cat([prefix_mask[row_ctx], rest_mask], dim=1)
            kwargs["use_cache"] = True
        else:
            kwargs["attention_mask"] = rest_mask
            kwargs["use_cache"] = False
        if keep_logits:
            kwargs["logits_to_keep"] = keep
        out = model(**kwargs)
        if wanted:
            logits = (out.logits if keep_logits else out.logits[keep]).float()
            norm = torch.logsumexp(logits, dim=-1)
            index = torch.tensor([flat[rt] for rt, _, _ in wanted], device=device)
            targets = torch.tensor([target for _, target, _ in wanted], device=device)
            token_lp.append(logits[index, targets] - norm[index])
            token_cand.append(torch.tensor([c for _, _, c in wanted]))
        if want_hidden:
            hidden = out.hidden_states[-1]
            for r, (a, k) in enumerate(chunk):
                if k == COMPLETION:
                    context_hidden[a] = hidden[r, len(inputs[r]) - 1]
            if needs.candidate_hidden:
                for r, a, j in users.get(n, []):
                    candidate_hidden[offsets[a] + j] = hidden[r, len(_row_inputs(plan, batch.contexts[a], j, needs)) - 1]

    scores = _sum_by_candidate(token_lp, token_cand, n_cand, device)
    return BatchResult(
        scores=scores,
        counts=counts,
        context_hidden=torch.stack(context_hidden) if needs.context_hidden else None,
        candidate_hidden=_stack_or_empty(candidate_hidden, _hidden_size(model)) if needs.candidate_hidden else None,
    )


def _sum_by_candidate(token_lp, token_cand, n_cand, device) -> torch.Tensor:
    if not token_lp:
        return torch.zeros(n_cand, device=device)
    values = torch.cat(token_lp)
    index = torch.cat(token_cand).to(values.device)
    return torch.zeros(n_cand, device=values.device, dtype=values.dtype).index_add(0, index, values)


def _stack_or_empty(items, width: int) -> torch.Tensor:
    return torch.stack(items) if items else torch.zeros((0, width))


def _hidden_size(model) -> int:
    return model.config.get_text_config().hidden_size


def _run_seq2seq(model, plan, batch, needs, pad_id, device, start_id, prefix_reuse) -> BatchResult:
    from transformers.modeling_outputs import BaseModelOutput

    ctxs = [plan.contexts[i] for i in batch.contexts]
    offsets = _offsets(plan, batch)
    n_cand = offsets[-1]
    want_hidden = needs.context_hidden or needs.candidate_hidden
    enc_ids, enc_mask = _pad([c.ids for c in ctxs], pad_id, left=False, device=device)
    encoded = model.get_encoder()(input_ids=enc_ids, attention_mask=enc_mask, return_dict=True) if prefix_reuse else None
    token_lp, token_cand = [], []
    counts = torch.zeros(n_cand, dtype=torch.long)
    context_hidden = [None] * len(ctxs)
    candidate_hidden = [None] * n_cand
    for chunk in batch.chunks:
        inputs = [[start_id] + _row_inputs(plan, batch.contexts[a], j, needs) for a, j in chunk]
        dec_ids, dec_mask = _pad(inputs, pad_id, left=False, device=device)
        row_ctx = torch.tensor([a for a, _ in chunk], device=device)
        kwargs = {"attention_mask": enc_mask[row_ctx], "decoder_input_ids": dec_ids,
                  "decoder_attention_mask": dec_mask, "output_hidden_states": want_hidden, "use_cache": False}
        if encoded is not None:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoded.last_hidden_state[row_ctx])
        else:
            kwargs["input_ids"] = enc_ids[row_ctx]
        out = model(**kwargs)
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
            token_lp.append(_token_logprobs(logits, torch.tensor(targets, device=device)))
            token_cand.append(torch.tensor(cand_of_token))
        if want_hidden:
            hidden = out.decoder_hidden_states[-1]
            for r, (a, j) in enumerate(chunk):
                if context_hidden[a] is None:
                    context_hidden[a] = hidden[r, 0]  # the decoder start position has read the whole context
                if j != COMPLETION and needs.candidate_hidden:
                    candidate_hidden[offsets[a] + j] = hidden[r, len(inputs[r]) - 1]
    scores = _sum_by_candidate(token_lp, token_cand, n_cand, device)
    return BatchResult(
        scores=scores,
        counts=counts,
        context_hidden=torch.stack(context_hidden) if needs.context_hidden else None,
        candidate_hidden=_stack_or_empty(candidate_hidden, _hidden_size(model)) if needs.candidate_hidden else None,
    )
