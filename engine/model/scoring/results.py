"""What a scoring pass collects and returns: the scored tokens as they come (:class:`TokenSink`), the state one
batch's passes share (:class:`BatchPass`), rows picked from the model's outputs and gathered at once (:class:`Pick`,
:func:`take`), and one batch's result (:class:`BatchResult`, built by :func:`batch_result`).

:func:`score_positions` is the one place where kept logits become scored tokens' log-probs: the positions a call
kept (:class:`Scored`, listed by :func:`scored_tokens`) -> logsumexp -> the sink. Log-probs and entropies are
computed in float32 (or wider) without materialising a full log-softmax.

Shared by the unpacked path (:mod:`llmrl.engine.model.scoring.causal`), the packed one
(:mod:`llmrl.engine.model.scoring.packed`) and seq2seq (:mod:`llmrl.engine.model.scoring.seq2seq`). It makes no
model call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llmrl.engine.graph import graph_zero, plus_zero
from llmrl.engine.model.scoring.normalise import at_least_float32, entropy_of
from llmrl.engine.model.scoring.planning import Needs
from llmrl.engine.model.scoring.vocab_chunks import active_output_layer, scored_logprobs_from_hidden

LOGITS_PER_PIECE = 1 << 24  # without gradients, rows are normalised in pieces of at most this many logits (64 MB)


def scored_logprobs(logits: torch.Tensor, targets: torch.Tensor, entropy: bool, index: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob of each target (``targets[i]`` at row ``index[i]`` of ``logits``, or at row ``i``) and, with
    ``entropy``, every row's entropy, in float32 (or wider).

    Without gradients the rows are normalised a piece at a time (:data:`LOGITS_PER_PIECE`), so no float32 copy of
    every row's logits, nor its exponential, exists at once; each row's values are those of the one-piece computation.
    With gradients it is one piece, as autograd keeps what the backward pass needs either way, unless the pass hands
    back hidden states instead of logits (:mod:`llmrl.engine.model.scoring.vocab_chunks`), whose chunks are computed
    again in the backward pass."""
    layer = active_output_layer()
    if layer is not None:  # an updater's pass, whose "logits" are the last hidden states (see vocab_chunks)
        return scored_logprobs_from_hidden(layer, logits, targets, entropy, index)
    rows = torch.arange(len(targets), device=targets.device) if index is None else index
    if (torch.is_grad_enabled() and logits.requires_grad) or logits.numel() <= LOGITS_PER_PIECE:
        full = at_least_float32(logits)
        norm = torch.logsumexp(full, dim=-1)
        return full[rows, targets] - norm[rows], entropy_of(full, norm) if entropy else None
    step = max(1, LOGITS_PER_PIECE // max(logits.shape[-1], 1))
    norms, entropies = [], []
    for first in range(0, logits.shape[0], step):
        piece = at_least_float32(logits[first:first + step])
        norms.append(torch.logsumexp(piece, dim=-1))
        if entropy:
            entropies.append(entropy_of(piece, norms[-1]))
    norm = torch.cat(norms)
    return at_least_float32(logits[rows, targets]) - norm[rows], torch.cat(entropies) if entropy else None


def needed_logprobs(needs, logits: torch.Tensor, targets: torch.Tensor,
                    index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`scored_logprobs` as a pass's ``needs`` ask (entropies with ``per_token`` and ``entropy``); a pass that
    computes no log-prob (``Needs.logprobs`` False) gets NaN in their place, and its output layer never runs."""
    if not needs.logprobs:
        return torch.full(targets.shape, float("nan"), device=targets.device), None
    return scored_logprobs(logits, targets, needs.per_token and needs.entropy, index)


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


class TokenSink:
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
            entropy=None, index=None, hidden=None) -> None:
        """``positions`` (a list, or None when per-token outputs are not kept) are the tokens' places in their
        candidates; ``entropy`` (every row's, from :func:`scored_logprobs`) and kept logits are those of ``logits``'
        rows selected by ``index``, if given; ``hidden`` (layer -> ``[n, H]``, with ``Needs.token_hidden``) holds
        the tokens' hidden states."""
        self.lp.append(logprobs)
        self.cand.append(torch.tensor(candidates))
        if not self.needs.per_token:
            return
        self.pos.append(torch.tensor(positions, dtype=torch.long))
        self.ids.append(targets.cpu())
        if self.needs.entropy:
            self.ent.append(entropy if index is None else entropy[index])
        if self.needs.token_logits:
            self.logits.append(at_least_float32(logits if index is None else logits[index]))
        if self.needs.token_hidden:
            self.hidden.append(hidden)


class Scored(NamedTuple):
    """A scored token of a model call: the (row, column) whose logits predict it, and where it belongs."""

    row: int
    column: int
    target: int  # its token id
    candidate: int  # its candidate (batch-local)
    position: int  # its place among the candidate's scored tokens


class KeptPositions:
    """The positions of a model call whose outputs are kept: ``mask`` (``[rows, width]`` boolean, on the CPU) and,
    for a kept ``(row, column)``, its place among the kept rows (boolean selection is row-major):
    ``kept[row, column]`` for one, :meth:`places_of` for many at once (no per-token Python indexing)."""

    def __init__(self, mask: torch.Tensor, rows: list[int] | None = None, columns: list[int] | None = None):
        if rows:
            mask[torch.tensor(rows), torch.tensor(columns)] = True
        self.mask = mask
        self.place = torch.full(mask.shape, -1, dtype=torch.long)
        self.place[mask] = torch.arange(int(mask.sum()))

    def __getitem__(self, row_column: tuple[int, int]) -> int:
        return int(self.place[row_column])

    def places_of(self, scored: list[Scored]) -> torch.Tensor:
        return self.place[torch.tensor([s.row for s in scored]), torch.tensor([s.column for s in scored])]


def scored_tokens(cand, row: int, first_column: int, candidate: int) -> list[Scored]:
    """The tokens candidate ``cand`` (:class:`~llmrl.engine.model.scoring.tokenization.CandidateTokens`) scores in a
    call whose row ``row`` holds its inputs from column ``first_column``: input ``t`` predicts ``rest[t + 1]``, token
    number ``t + 1 - first_scored`` of its scored tokens. (Its first rest token, when scored, is predicted by its
    prefix's last logits: see :func:`prefix_outputs`.)"""
    return [Scored(row, first_column + t, cand.rest[t + 1], candidate, t + 1 - cand.first_scored)
            for t in range(max(cand.first_scored - 1, 0), len(cand.rest) - 1)]


def scored_in_call(cand) -> int:
    """How many of ``cand``'s scored tokens a candidate row scores (the others come from the prefix's logits)."""
    return len(cand.rest) - max(cand.first_scored, 1)


def score_positions(sink: TokenSink, logits: torch.Tensor, kept: KeptPositions, scored: list[Scored], hidden_states,
                    device) -> None:
    """Add ``scored`` to ``sink``: their log-probs from ``logits`` (the call's kept rows, placed by ``kept``) and,
    with ``Needs.token_hidden``, the hidden states at their positions."""
    if not scored:
        return
    needs = sink.needs
    index = kept.places_of(scored).to(device)
    targets = torch.tensor([s.target for s in scored], device=device)
    logprobs, entropy = needed_logprobs(needs, logits, targets, index)
    hidden = None
    if needs.token_hidden:
        rows = torch.tensor([s.row for s in scored], device=device)
        cols = torch.tensor([s.column for s in scored], device=device)
        hidden = at(hidden_states, needs.layers, rows, cols)
    sink.add(logprobs, [s.candidate for s in scored], [s.position for s in scored] if needs.per_token else None,
             targets, logits, entropy, index, hidden)


@dataclass
class BatchPass:
    """What one causal batch's passes collect as they run: the scored tokens, each candidate's count of them, the
    logits and hidden state after each context's prefix (picked, gathered later) and every call's logits."""

    needs: Needs
    n_contexts: int
    n_candidates: int
    sink: TokenSink = field(init=False)
    counts: torch.Tensor = field(init=False)
    last_logits: list = field(init=False)
    last_hidden: list = field(init=False)
    touched: list = field(default_factory=list)  # every model call's logits (see batch_result)

    def __post_init__(self):
        self.sink = TokenSink(self.needs)
        self.counts = torch.zeros(self.n_candidates, dtype=torch.long)
        self.last_logits = [None] * self.n_contexts
        self.last_hidden = [None] * self.n_contexts

    def prefix_ends(self, a: int, logits, hidden_states, index: tuple, logits_index: tuple | None = None) -> None:
        """Context ``a``'s prefix ends at ``index`` of this call's outputs (``logits_index`` in its kept logits)."""
        self.last_logits[a] = Pick(logits, index if logits_index is None else logits_index)
        self.last_hidden[a] = Pick(hidden_states, index) if self.needs.hidden else None


@dataclass
class BatchResult:
    """Per-candidate scores of one batch (candidates in context order) and optional hidden states and tokens."""

    scores: torch.Tensor  # [n_candidates] sum of token log-probs
    counts: torch.Tensor  # [n_candidates] number of scored tokens
    context_hidden: dict[int, torch.Tensor] | None  # layer -> [n_contexts, H]
    candidate_hidden: dict[int, torch.Tensor] | None  # layer -> [n_candidates, H]
    tokens: Tokens | None = None  # with Needs.per_token


def prefix_outputs(ctxs, offsets, state: BatchPass, device):
    """What the prefix passes alone give: the first scored token of candidates that start right after the shared
    prefix (scored from the prefix's last logits), and hidden states at the prefix's end. Returns per-context and
    per-candidate lists of hidden states, to be completed by the candidate passes."""
    needs, sink, counts, last_hidden = state.needs, state.sink, state.counts, state.last_hidden
    layers, want_hidden, n_cand = needs.layers, needs.hidden, offsets[-1]
    # Candidates whose first scored token directly follows the shared prefix.
    firsts = [(a, j) for a, c in enumerate(ctxs) for j, cand in enumerate(c.candidates)
              if cand.first_scored == 0 and cand.rest]
    if firsts:
        # each prefix's last logits once, however many of its candidates they score (their normaliser and, in an
        # updater's pass, their output-layer product are computed once per context, not once per candidate)
        prefixes = sorted({a for a, _ in firsts})
        row_of = {a: k for k, a in enumerate(prefixes)}
        logits = take([state.last_logits[a] for a in prefixes])
        index = torch.tensor([row_of[a] for a, _ in firsts], device=device)
        targets = torch.tensor([ctxs[a].candidates[j].rest[0] for a, j in firsts], device=device)
        hidden = (take_layers([last_hidden[a] for a, _ in firsts], layers)
                  if needs.token_hidden else None)  # the prefix's last position predicts these tokens
        logprobs, entropy = needed_logprobs(needs, logits, targets, index)
        sink.add(logprobs, [offsets[a] + j for a, j in firsts], [0] * len(firsts), targets, logits, entropy,
                 index=index, hidden=hidden)
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


def batch_result(model, needs, sink: TokenSink, counts, context_hidden, candidate_hidden, device,
                 touched: list[torch.Tensor]) -> BatchResult:
    """One batch's result from what its passes collected. With gradients, every call's logits (``touched``) are tied
    to every output with weight zero."""
    values = torch.cat(sink.lp) if sink.lp else torch.zeros(0, device=device)
    index = torch.cat(sink.cand) if sink.cand else torch.zeros(0, dtype=torch.long)
    scores = torch.zeros(len(counts), device=values.device, dtype=values.dtype).index_add(0, index.to(values.device),
                                                                                          values)
    tokens = None
    if needs.per_token:
        width, vocab = hidden_size(model), model.config.get_text_config().vocab_size
        tokens = Tokens(values, index, cat_long(sink.pos), cat_long(sink.ids),
                        (torch.cat(sink.ent) if sink.ent else torch.zeros(0, device=device)) if needs.entropy else None,
                        cat_layers(sink.hidden, needs.layers, width, device) if needs.token_hidden else None,
                        (torch.cat(sink.logits) if sink.logits else torch.zeros((0, vocab), device=device))
                        if needs.token_logits else None)
    context_hidden = (take_layers(context_hidden, needs.layers, hidden_size(model), device)
                      if needs.context_hidden else None)
    candidate_hidden = (take_layers(candidate_hidden, needs.layers, hidden_size(model), device)
                        if needs.candidate_hidden else None)
    if torch.is_grad_enabled() and touched:
        # Every model call reaches the loss (with weight zero), so a backward pass visits every layer of every call
        # whatever the loss reads: under ZeRO-3 each replica gathers the same weights in the same order.
        zero = graph_zero(*touched)
        scores = scores + zero
        if tokens is not None:
            tokens.logprobs = tokens.logprobs + zero
            tokens.entropy = plus_zero(tokens.entropy, zero)
            tokens.logits = plus_zero(tokens.logits, zero)
            tokens.hidden = plus_zero(tokens.hidden, zero)
        context_hidden = plus_zero(context_hidden, zero)
        candidate_hidden = plus_zero(candidate_hidden, zero)
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


def at(hidden_states, layers, rows, cols) -> dict[int, torch.Tensor]:
    """The hidden states of ``layers`` (indices into Hugging Face's ``hidden_states``) at ``[rows, cols]``."""
    return {layer: hidden_states[layer][rows, cols] for layer in layers}


def cat_layers(items: list[dict], layers, width: int, device) -> dict[int, torch.Tensor]:
    """Per layer, the items' hidden states concatenated in order; ``[0, width]`` when none."""
    return {layer: torch.cat([d[layer] for d in items]) if items else torch.zeros((0, width), device=device)
            for layer in layers}


def cat_long(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def hidden_size(model) -> int:
    return model.config.get_text_config().hidden_size
