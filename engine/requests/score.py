"""The ``score`` request kind, behind ``Caller.score`` and ``Caller.custom_module_fns``: candidates' log-probs and
heads' outputs from one forward pass.

Client half: contexts are split across the LLM's replicas in contiguous ranges of roughly equal cost (each
context stays whole); every rank of a replica receives the replica's share. The replicas' leaders answer,
and :class:`Finish` turns their per-context entries into what the call returns (sum or mean, the log-policy
over the candidates, probabilities, head outputs, and with ``per_token`` each candidate's tokens, their log-probs
and entropies). Server half: the backend runs the forward pass and the replica's leader cuts the outputs per
context as CPU tensors (per-token values as one flat tensor per context, cut per candidate on the client).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from llmrl.engine.requests.base import Kind, Run, replica_parts, split_by_cost

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


def send(run: Run, llm: str, request: ScoreRequest, finish: Finish) -> Future:
    contexts, candidates = request.contexts, request.candidates
    costs = [_size(c) + (sum(_size(x) + _size(c) // 8 for x in candidates[i]) if candidates else 0)
             for i, c in enumerate(contexts)]
    bounds = split_by_cost(costs, len(run.replicas(llm)))

    def share(start: int, stop: int) -> ScoreRequest:
        return replace(request, contexts=contexts[start:stop],
                       candidates=None if candidates is None else candidates[start:stop])

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=run.config.llms[llm].lockstep)
    return run.submit(NAME, parts, lambda values: finish([e for leader in leaders for e in values[leader]]))


def _size(item) -> int:
    """A context's or candidate's cost in characters (a token is about four)."""
    return len(item) if isinstance(item, str) else 4 * len(item)


def handle(replica, request: ScoreRequest):
    out = replica.backend.score(request.contexts, request.candidates, request.heads, request.peft_adapter,
                                request.minibatch_size, per_token=request.per_token, entropy=request.entropy,
                                add_eos=request.add_eos)
    if not replica.answers:
        return None
    scores = out.candidate_scores.detach().float().cpu()
    counts = out.candidate_token_counts.cpu()
    heads = {k: v.detach().cpu() for k, v in out.heads.items()}
    sizes = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts).tolist()
    per_token = {}
    if request.per_token:
        token_counts = torch.bincount(out.token_candidate.cpu(), minlength=len(scores))
        token_starts = [0, *torch.cumsum(token_counts, 0).tolist()]
        per_token = {"token_logprobs": out.token_logprobs.detach().float().cpu(), "token_ids": out.token_ids.cpu()}
        if out.token_entropy is not None:
            per_token["token_entropy"] = out.token_entropy.detach().float().cpu()
    entries, start = [], 0
    for i, k in enumerate(sizes):
        entry = {"scores": scores[start:start + k].clone(), "counts": counts[start:start + k].clone(), "heads": {}}
        for key, value in heads.items():
            per_context = out.head_levels[key] == "context"
            entry["heads"][key] = value[i].clone() if per_context else value[start:start + k].clone()
        if per_token:
            first, last = token_starts[start], token_starts[start + k]
            entry["token_counts"] = token_counts[start:start + k].clone()
            entry.update({key: value[first:last].clone() for key, value in per_token.items()})
        entries.append(entry)
        start += k
    return entries


KIND = Kind(NAME, ScoreRequest, handle)
