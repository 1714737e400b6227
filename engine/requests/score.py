"""The ``score`` request kind, behind ``Caller.score`` and ``Caller.custom_module_fns``: candidates' log-probs and
heads' outputs from one forward pass.

Client half: contexts are split across the LLM's replicas in contiguous ranges of roughly equal cost (each
context stays whole); every rank of a replica receives the replica's share. The replicas' leaders answer,
and :class:`Finish` turns their per-context entries into what the call returns (sum or mean, the log-policy
over the candidates, probabilities, head outputs). Server half: the backend runs the forward pass and the
replica's leader cuts the outputs per context as CPU tensors.
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

    contexts: list[str]
    candidates: list[list[str]] | None
    heads: tuple[str, ...] = ()
    peft_adapter: str | None = None
    minibatch_size: int | None = None


@dataclass(frozen=True)
class Finish:
    """How the client turns per-context entries into the call's result (client-side only, never sent)."""

    reduction: str = "sum"
    normalize: bool = False
    probabilities: bool = False
    scores: bool = True  # False: custom_module_fns, heads only

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
            out.append({"score": value, **entry["heads"]} if entry["heads"] else value)
        return out


def send(run: Run, llm: str, request: ScoreRequest, finish: Finish) -> Future:
    contexts, candidates = request.contexts, request.candidates
    costs = [len(c) + (sum(len(x) + len(c) // 8 for x in candidates[i]) if candidates else 0)
             for i, c in enumerate(contexts)]
    bounds = split_by_cost(costs, len(run.replicas(llm)))

    def share(start: int, stop: int) -> ScoreRequest:
        return replace(request, contexts=contexts[start:stop],
                       candidates=None if candidates is None else candidates[start:stop])

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=run.config.llms[llm].lockstep)
    return run.submit(NAME, parts, lambda values: finish([e for leader in leaders for e in values[leader]]))


def handle(replica, request: ScoreRequest):
    out = replica.backend.score(request.contexts, request.candidates, request.heads, request.peft_adapter,
                                request.minibatch_size)
    if not replica.answers:
        return None
    scores = out.candidate_scores.detach().float().cpu()
    counts = out.candidate_token_counts.cpu()
    heads = {k: v.detach().cpu() for k, v in out.heads.items()}
    sizes = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts).tolist()
    entries, start = [], 0
    for i, k in enumerate(sizes):
        entry = {"scores": scores[start:start + k].clone(), "counts": counts[start:start + k].clone(), "heads": {}}
        for key, value in heads.items():
            per_context = out.head_levels[key] == "context"
            entry["heads"][key] = value[i].clone() if per_context else value[start:start + k].clone()
        entries.append(entry)
        start += k
    return entries


KIND = Kind(NAME, ScoreRequest, handle)
