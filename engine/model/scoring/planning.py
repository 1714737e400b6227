"""Plan the forward passes of a scoring request: which contexts share a batch, which candidate rows share a
chunk, which rows are shared between candidates, and how many model calls the plan makes.

Batches are formed by a token budget (padded tokens, cache included) and a row cap, not a fixed row
count, so memory stays bounded with long contexts; :func:`group_greedily` is the one greedy grouping behind every
such decision (generation uses it too). A candidate row feeds only the tokens that predict a scored
token, and a candidate whose inputs are a prefix of another's reads that row (causal attention makes
the shared positions identical). With ``packed`` (causal models whose attention takes a 4-D mask), a batch's
contexts and all their candidate rows go into a single model call (:mod:`llmrl.engine.model.scoring.packed`), and
batches are formed by the tokens of contexts and candidates together; a context too wide for the budget with
its candidates, or candidates long enough that packing them costs more attention than it saves
(:func:`packing_pays`), turn packing off for the request. The number of model calls of each batch is decided here, once:
:mod:`llmrl.engine.model.scoring.run` makes exactly those calls, and ranks in lockstep pad to the maximum.

It also lays token rows out as tensors (:func:`pad_rows`) and numbers a batch's candidates
(:func:`context_offsets`). This module is pure planning over token ids: it runs no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmrl.engine.model.scoring.tokenization import TokenPlan, common_prefix_length

COMPLETION = -1  # row index of a context's completion row (the hidden state of its last token)
# A model call reads every weight once, which on a CPU costs as much as encoding dozens of tokens (measured with
# SmolLM2-135M on 2 cores: a 3-token pass took 125 ms, the time of ~90 tokens). Packed, a pass over the common prefix
# is kept only if it saves re-encoding at least this many tokens in the packed call; and the choice between packing
# and the unpacked passes counts each of the latter's prefix passes as this many tokens.
MODEL_CALL_TOKENS = 64
COMMON_PASS_MIN_SAVING = MODEL_CALL_TOKENS


@dataclass(frozen=True)
class Needs:
    """What a request needs besides summed scores (none of it changes the model calls a plan makes)."""

    context_hidden: bool = False  # hidden state at each context's last token
    candidate_hidden: bool = False  # hidden state at each candidate's last token
    per_token: bool = False  # each scored token's log-prob and id, kept apart (not only summed)
    entropy: bool = False  # the entropy of the model's distribution at each scored position (with per_token)
    token_hidden: bool = False  # hidden states at the position predicting each scored token (with per_token)
    token_logits: bool = False  # float32 logits at the position predicting each scored token (with per_token)
    logprobs: bool = True  # False: the scored tokens' log-probs are not computed (NaN in their place; heads only)
    layers: tuple[int, ...] = (-1,)  # indices into Hugging Face's hidden_states kept wherever hidden states are

    @property
    def hidden(self) -> bool:
        """Whether any hidden state is kept (the model calls then return ``hidden_states``)."""
        return self.context_hidden or self.candidate_hidden or self.token_hidden


@dataclass
class BatchSpec:
    """One batch: its contexts, the chunks of candidate rows of its candidate passes, and its model calls."""

    contexts: list[int]  # indices into the plan's contexts
    # rows: (position in contexts, candidate or COMPLETION)
    chunks: list[list[tuple[int, int]]] = field(default_factory=list)
    # Causal models: candidate (a, j) reads its logits from the row of candidate (a, cover[a, j]), whose inputs
    # start with its own (" turn left" and " turn right" both need only " turn": one row serves both).
    cover: dict[tuple[int, int], int] = field(default_factory=dict)
    common: int = 0  # causal: tokens every context of the batch shares, encoded once (0: no such pass)
    own_prefixes: bool = False  # causal: a pass over each context's own part of its shared prefix
    encoder_pass: bool = False  # seq2seq: the encoder runs once and its output is reused by every chunk
    packed: bool = False  # causal: own prefixes and every candidate row in one call (chunks holds one chunk)

    @property
    def num_rows(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def model_calls(self) -> int:
        """Model calls :func:`llmrl.engine.model.scoring.run.run_batch` makes for this batch."""
        if self.packed:
            return int(self.common > 0) + int(self.own_prefixes or self.num_rows > 0)
        return int(self.common > 0) + int(self.own_prefixes) + int(self.encoder_pass) + len(self.chunks)


def group_greedily(widths: Sequence[int], budget: int, max_rows: int, *, rows_each: int = 1, extra_width: int = 0
         ) -> list[list[int]]:
    """Group items, in order, greedily: a group of n items costs ``n x rows_each`` rows of
    ``widest + extra_width`` tokens, and must stay within ``budget`` tokens and ``max_rows`` rows (an item
    alone always forms a group). Returns the items' indices, group by group."""
    groups: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for i, width in enumerate(widths):
        width = max(width, 1)
        wider = max(widest, width)
        rows = (len(current) + 1) * rows_each
        if current and (rows * (wider + extra_width) > budget or rows > max_rows):
            groups.append(current)
            current, wider = [], width
        current.append(i)
        widest = wider
    if current:
        groups.append(current)
    return groups


def row_inputs(plan: TokenPlan, ctx_index: int, cand: int, needs: Needs) -> list[int]:
    """Tokens a row feeds to the model after the shared prefix (causal) or after the start token (seq2seq)."""
    ctx = plan.contexts[ctx_index]
    if cand == COMPLETION:
        return [] if plan.kind == "seq2seq" else ctx.ids[ctx.shared:]
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
    return (scored_in_row or hidden_in_row) and len(row_inputs(plan, ctx_index, cand, needs)) > 0


def plan_batches(plan: TokenPlan, token_budget: int, max_rows: int, needs: Needs, encoder_reuse: bool = True,
                 packed: bool = False, cached: Callable[[list[int]], int] | None = None,
                 attention: float = 0.0) -> list[BatchSpec]:
    """Group contexts into batches and their candidate rows into chunks within the budget.

    ``encoder_reuse`` (seq2seq): encode each batch's contexts once and reuse the output for every chunk.
    ``packed`` (causal): one call per batch for its contexts and candidates (see the module's docstring);
    ``max_rows`` then caps the contexts of a batch, and a common prefix gets a pass of its own only when that saves
    :data:`COMMON_PASS_MIN_SAVING` tokens. ``cached`` (packed, with the cache across calls) says how many leading
    tokens of a sequence the cache holds: what it holds needs no encoding. ``attention`` (packed): a layer's attention
    work per token and attended column relative to its linear work per token
    (:func:`~llmrl.engine.model.scoring.packed.attention_per_column`); with it, a request whose candidates are long
    enough that packing costs more attention than it saves runs unpacked (:func:`packing_pays`).
    """
    order = sorted(range(len(plan.contexts)), key=lambda i: -_prefix_len(plan, i))
    widths = [_prefix_len(plan, i) for i in order]
    if packed and plan.kind == "causal":
        rows = [_candidate_rows(plan, i, needs) for i in order]
        widths = [w + sum(r) for w, r in zip(widths, rows)]
        packed = max(widths, default=0) <= token_budget and packing_pays(
            [_prefix_len(plan, i) for i in order], rows, attention)
        if not packed:
            widths = [_prefix_len(plan, i) for i in order]
    groups = group_greedily(widths, token_budget, max_rows)
    batches = [BatchSpec([order[k] for k in group]) for group in groups]
    for batch in batches:
        if plan.kind == "causal":
            prefixes = [plan.contexts[i].prefix for i in batch.contexts]
            batch.common = common_prefix_length(*prefixes)
            if len({plan.contexts[i].adapter for i in batch.contexts}) > 1:  # contexts of several LoRA adapters
                batch.common = 0
            if packed and batch.common > 0:  # the part the cache across calls holds needs no encoding at all
                held = cached(prefixes[0][:batch.common]) if cached is not None else 0
                if (batch.common - min(held, batch.common)) * (len(prefixes) - 1) < COMMON_PASS_MIN_SAVING:
                    batch.common = 0
            batch.own_prefixes = max((len(p) - batch.common for p in prefixes), default=0) > 0
        else:
            batch.encoder_pass = encoder_reuse
        if packed and plan.kind == "causal":
            rows = [row for chunk in _chunk_rows(plan, batch, 1 << 62, 1 << 62, needs) for row in chunk]
            batch.chunks, batch.packed = ([rows] if rows else []), True
        else:
            batch.chunks = _chunk_rows(plan, batch, token_budget, max_rows, needs)
    return batches


def packing_pays(prefixes: list[int], rows: list[list[int]], attention: float) -> bool:
    """Whether packing costs no more than the unpacked passes, for contexts of ``prefixes`` tokens whose candidate
    rows feed ``rows[i]`` tokens each, by the packed layout's cost model: tokens x (1 + ``attention`` x attended
    columns). Packed, a context's rows sit side by side in its row, and every token is scored against all of it (the
    mask throws most away); unpacked, each candidate row, padded to the context's widest, attends to its context's
    prefix and itself, and the prefix takes a call of its own (:data:`MODEL_CALL_TOKENS`, counted per context although
    one call encodes a batch's prefixes: an estimate that leans towards packing). So actions of a few tokens
    pack, and a GRPO update's continuations of hundreds of tokens do not (``benchmarks/packing_choice.py``: an update's
    pass over 2 prompts x 8 continuations of 256 tokens, SmolLM2-135M's shape on a CPU, took 25 s unpacked and 40 s
    packed). With ``attention`` 0, packing always pays (it never feeds more tokens)."""
    packed = unpacked = 0.0
    for prefix, lengths in zip(prefixes, rows):
        tokens = prefix + sum(lengths)
        widest = max(lengths, default=0)
        packed += tokens * (1 + attention * tokens)
        unpacked += MODEL_CALL_TOKENS + prefix * (1 + attention * prefix) \
            + len(lengths) * widest * (1 + attention * (prefix + widest))
    return packed <= unpacked


def _candidate_rows(plan: TokenPlan, i: int, needs: Needs) -> list[int]:
    """The tokens each candidate row of context ``i`` feeds (rows shared between candidates counted once)."""
    ctx = plan.contexts[i]
    wanted = [j for j in range(len(ctx.candidates)) if _needs_row(plan, i, j, needs)]
    lengths = [len(row_inputs(plan, i, k, needs)) for k in _cover_rows(plan, i, 0, wanted, needs, {})]
    if needs.context_hidden and ctx.shared < len(ctx.ids):
        lengths.append(len(row_inputs(plan, i, COMPLETION, needs)))
    return lengths


def _cover_rows(plan: TokenPlan, i: int, a: int, wanted: list[int], needs: Needs, cover: dict) -> list[int]:
    """Candidates whose rows are computed; fills ``cover`` for every wanted candidate. A candidate whose
    inputs are a prefix of another's reads that row: causal attention makes the shared positions identical."""
    inputs = {j: row_inputs(plan, i, j, needs) for j in wanted}
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
    start = 1 if plan.kind == "seq2seq" else 0  # the decoder start token
    widths = [len(row_inputs(plan, batch.contexts[a], j, needs)) + start for a, j in rows]
    return [[rows[k] for k in group] for group in group_greedily(widths, budget, max_rows, extra_width=prefix)]


def context_offsets(plan: TokenPlan, batch: BatchSpec) -> list[int]:
    """Where each context's candidates start among the batch's candidates (batch-local numbering), then their
    total."""
    offsets, total = [], 0
    for i in batch.contexts:
        offsets.append(total)
        total += len(plan.contexts[i].candidates)
    return offsets + [total]


def pad_rows(seqs: list[list[int]], pad_id: int, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as ``(ids, attention_mask)`` ``[rows, widest]``, padded on the left or the right."""
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
