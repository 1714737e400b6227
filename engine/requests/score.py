"""The ``score`` request kind, behind ``Caller.score`` and ``Caller.custom_module_fns``: candidates' log-probs and
heads' outputs from one forward pass.

Client half (:func:`plan_shares`): contexts are split across the LLM's replicas in contiguous ranges of roughly
equal cost. A context whose cost alone is above a replica's fair share (the total over the number of replicas:
one context with 256 candidates, fewer contexts than replicas) is cut into contiguous pieces of its candidates
spread over the replicas; a replica receives such a context once, with its piece of the candidates, and so
encodes it once. Small contexts stay whole. Every rank of a replica receives the replica's share; under
lockstep every replica takes part, even with nothing to do. The replicas' leaders answer one entry per piece;
:func:`merge_entries` joins the pieces of a context back into one entry (candidate-level values concatenated in
order, context-level head outputs from the first piece), token-level head outputs are cut per candidate
(:func:`cut_token_heads`), and :class:`Finish` turns the entries into what the
call returns (sum or mean, the log-policy over the candidates, probabilities, head outputs, and with
``per_token`` each candidate's tokens, their log-probs and entropies), so ``normalize`` and ``reduction`` always
see a context's whole candidate list. Server half: the backend runs the forward pass and the replica's leader
cuts the outputs per context as CPU tensors (per-token values as one flat tensor per context, cut per candidate
on the client). ``head_kwargs`` values with one entry per context are sliced like the contexts (each piece takes
its context's entry); the others reach every replica whole.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from llmrl.engine.requests.base import (
    Kind,
    Piece,
    Run,
    gather_pieces,
    group_pieces,
    piece_parts,
    split_by_cost,
)
from llmrl.plugins.per_sample import is_per_sample, take_samples

NAME = "score"


@dataclass(frozen=True)
class ScoreRequest:
    """One replica's share of a score / custom_module_fns call."""

    contexts: list[str | list[int]]  # text, or token ids used as given
    candidates: list[list[str | list[int]]] | None
    heads: tuple[str, ...] = ()
    peft_adapter: str | None = None
    minibatch_size: int | None = None
    per_token: bool = False
    entropy: bool = False
    add_eos: bool = False
    head_kwargs: dict | None = None  # keyword arguments for the heads' forward


@dataclass(frozen=True)
class Finish:
    """How the client turns per-context entries into the call's result (client-side only, never sent)."""

    reduction: str = "sum"
    normalize: bool = False
    probabilities: bool = False
    scores: bool = True  # False: custom_module_fns, heads only
    per_token: bool = False  # one dict per context with each candidate's tokens, log-probs (and entropies)

    def __call__(self, entries: list[dict]):
        out = []
        for entry in entries:
            if not self.scores:
                out.append(dict(entry["heads"]))
                continue
            value = entry["scores"]
            if self.reduction == "mean":
                value = value / entry["counts"].clamp(min=1).to(value.dtype)
            if self.normalize and value.numel():
                value = value.log_softmax(0)
            if self.probabilities:
                value = value.exp()
            if self.per_token:
                counts = entry["token_counts"].tolist()
                tokens = {"score": value, "tokens": list(entry["token_ids"].split(counts)),
                          "logprobs": list(entry["token_logprobs"].split(counts))}
                if "token_entropy" in entry:
                    tokens["entropy"] = list(entry["token_entropy"].split(counts))
                out.append({**tokens, **entry["heads"]})
                continue
            out.append({"score": value, **entry["heads"]} if entry["heads"] else value)
        return out


def plan_shares(contexts: list[str], candidates: list[list[str]] | None, replicas: int,
                cut_contexts: bool = True) -> list[list[Piece]]:
    """Each replica's pieces of the call. The cost of a context is its length plus, per candidate, the
    candidate's length and an eighth of the context's (characters stand in for tokens). A context whose cost is
    above ``total / replicas`` and that has two candidates or more is cut between candidates (unless
    ``cut_contexts`` is False: a call with heads, which may read a context's candidates together, or be given one
    value per candidate); everything else stays whole; the pieces then go to replicas in contiguous ranges of
    roughly equal cost. (Token ids count four characters each.)"""
    def cost(i: int) -> float:
        return _size(contexts[i]) + (sum(_size(x) + _size(contexts[i]) // 8 for x in candidates[i])
                                     if candidates else 0)

    totals = [cost(i) for i in range(len(contexts))]
    fair = sum(totals) / replicas
    atoms, costs = [], []
    for i, context in enumerate(contexts):
        cands = candidates[i] if candidates is not None else []
        if cut_contexts and totals[i] > fair and len(cands) > 1:  # every piece encodes the context: spread its cost
            atoms += [Piece(i, j, j + 1) for j in range(len(cands))]
            costs += [_size(x) + _size(context) // 8 + _size(context) / len(cands) for x in cands]
        else:
            atoms.append(Piece(i, 0, len(cands)))
            costs.append(totals[i])
    return group_pieces(atoms, split_by_cost(costs, replicas))


def merge_entries(entries: list[dict], head_levels: dict[str, str]) -> dict:
    """One context's entry from the entries of its pieces, in candidate order. Candidate-level values (scores,
    counts, candidate-level heads' outputs, any per-candidate list) are concatenated: tensors along their first
    dimension, lists end to end, dicts key by key; a context-level head's output (``head_levels[key] ==
    "context"``) is the same for every piece and is taken from the first."""
    if len(entries) == 1:
        return entries[0]
    first = entries[0]
    merged = {key: _concat([e[key] for e in entries]) for key in first if key != "heads"}
    if "heads" in first:
        merged["heads"] = {key: value if head_levels[key] == "context"
                           else _concat([e["heads"][key] for e in entries])
                           for key, value in first["heads"].items()}
    return merged


def cut_token_heads(entry: dict, head_levels: dict[str, str]) -> dict:
    """A context's entry with each token-level head's flat output (a tensor, or a dict of tensors) cut into one
    tensor per candidate, by the candidates' numbers of scored tokens."""
    token_keys = [key for key in entry.get("heads", {}) if head_levels.get(key) == "token"]
    if not token_keys:
        return entry
    counts = entry["token_counts"].tolist()
    heads = dict(entry["heads"])
    for key in token_keys:
        value = heads[key]
        heads[key] = ({k: list(v.split(counts)) for k, v in value.items()} if isinstance(value, dict)
                      else list(value.split(counts)))
    return {**entry, "heads": heads}


def _concat(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, list):
        return [x for v in values for x in v]
    if isinstance(first, dict):
        return {key: _concat([v[key] for v in values]) for key in first}
    raise TypeError(f"cannot join per-candidate values of type {type(first).__name__} across pieces")


def send(run: Run, llm: str, request: ScoreRequest, finish: Finish, head_levels: dict[str, str]) -> Future:
    """Split ``request`` over ``llm``'s replicas; a future of ``finish(entries)``, one entry per context.
    ``head_levels`` gives each head key's level (``"context"`` or ``"candidate"``), for merging pieces."""
    contexts, candidates = request.contexts, request.candidates
    # A head sees the candidates of its call's piece only: with heads, every context stays whole on one replica
    # (a head may read a context's candidates together, as a softmax over them does, or index per-candidate values).
    shares = plan_shares(contexts, candidates, len(run.replicas(llm)), cut_contexts=not request.heads)

    def share(pieces: list[Piece]) -> ScoreRequest:
        kwargs = request.head_kwargs
        if kwargs:
            inputs = [p.input for p in pieces]
            kwargs = {k: take_samples(v, inputs) if is_per_sample(v, len(contexts)) else v for k, v in kwargs.items()}
        return replace(request, contexts=[contexts[p.input] for p in pieces],
                       candidates=None if candidates is None else [candidates[p.input][p.start:p.stop]
                                                                   for p in pieces], head_kwargs=kwargs)

    parts, answering = piece_parts(run, llm, shares, share, keep_empty=run.config.llms[llm].lockstep)

    def assemble(values: dict) -> list:
        return finish([cut_token_heads(merge_entries(pieces, head_levels), head_levels)
                       for pieces in gather_pieces(values, answering, len(contexts))])

    return run.submit(NAME, parts, assemble)


def _size(item) -> int:
    """A context's or candidate's cost in characters (a token is about four)."""
    return len(item) if isinstance(item, str) else 4 * len(item)


def handle(replica, request: ScoreRequest):
    out = replica.backend.score(request)
    if not replica.answers:
        return None
    scores = out.candidate_scores.detach().float().cpu()
    counts = out.candidate_token_counts.cpu()
    heads = {k: _each(v, lambda t: t.detach().cpu()) for k, v in out.heads.items()}
    sizes = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts).tolist()
    per_token = {}
    if out.token_candidate is not None:  # asked for, or read by a head
        token_counts = torch.bincount(out.token_candidate.cpu(), minlength=len(scores))
        token_starts = [0, *torch.cumsum(token_counts, 0).tolist()]
    if request.per_token:
        per_token = {"token_logprobs": out.token_logprobs.detach().float().cpu(), "token_ids": out.token_ids.cpu()}
        if out.token_entropy is not None:
            per_token["token_entropy"] = out.token_entropy.detach().float().cpu()
    entries, start = [], 0
    for i, k in enumerate(sizes):
        entry = {"scores": scores[start:start + k].clone(), "counts": counts[start:start + k].clone(), "heads": {}}
        if out.token_candidate is not None:
            first, last = token_starts[start], token_starts[start + k]
            entry["token_counts"] = token_counts[start:start + k].clone()
            entry.update({key: value[first:last].clone() for key, value in per_token.items()})
        for key, value in heads.items():
            level = out.head_levels[key]
            rows = i if level == "context" else slice(start, start + k) if level == "candidate" else slice(first, last)
            entry["heads"][key] = _each(value, lambda t, rows=rows: t[rows].clone())
        entries.append(entry)
        start += k
    return entries


def _each(value, fn):
    """``fn`` applied to a head's output: a tensor, or each tensor of a dict."""
    return {k: fn(v) for k, v in value.items()} if isinstance(value, dict) else fn(value)


KIND = Kind(name=NAME, payload=ScoreRequest, send=send, handle=handle, backend_method="score",
            caller_methods=("score_async", "score", "custom_module_fns_async", "custom_module_fns"))
