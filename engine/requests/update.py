"""The ``update`` request kind, behind ``Caller.update``: the LLM's updater runs on every replica, each on its share.

Client half: samples are split evenly across replicas. Keyword arguments are checked (every number finite,
:mod:`llmrl.engine.requests.finite`; the updater's declared per-sample arguments shaped like the call,
:mod:`llmrl.plugins.per_sample`) before anything is sent; the per-sample ones (declared, or by the length rule for
an updater that declares nothing) are sliced like the contexts, the others reach every replica whole. Every replica
takes part, even with no sample (its collectives must line up with the others'). Server half: the backend runs the
updater on an :class:`~llmrl.plugins.contracts.UpdateBatch`; each replica's leader answers with its stats.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.requests.base import Kind, Run, replica_parts, split_evenly
from llmrl.engine.requests.finite import check_finite
from llmrl.plugins.contracts import UpdateBatch
from llmrl.plugins.per_sample import check_per_sample, per_sample_keys, take_samples

NAME = "update"


@dataclass(frozen=True)
class UpdateRequest:
    """One replica's share of an update call."""

    contexts: list[str | list[int]]  # text, or token ids used as given
    candidates: list[list[str | list[int]]] | None
    kwargs: dict = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)  # positions of these samples in the whole call
    global_size: int = 0
    replica_sizes: list[int] = field(default_factory=list)
    per_sample: list[str] = field(default_factory=list)  # the kwargs sliced with the samples


def send(run: Run, llm: str, contexts: list, candidates: list[list] | None, kwargs: dict,
         declared: dict | None = None, updater: str = "") -> Future:
    """``declared``: the updater's ``per_sample_args`` declaration, as its servers described it (None: the length
    rule)."""
    check_finite(kwargs)
    check_per_sample(kwargs, contexts, candidates, declared, updater)
    n = len(contexts)
    keys = per_sample_keys(kwargs, n, declared)
    bounds = split_evenly(n, len(run.replicas(llm)))
    sizes = [stop - start for start, stop in bounds]

    def share(start: int, stop: int) -> UpdateRequest:
        sliced = {k: (take_samples(v, range(start, stop)) if k in keys else v) for k, v in kwargs.items()}
        return UpdateRequest(contexts[start:stop], None if candidates is None else candidates[start:stop], sliced,
                             list(range(start, stop)), n, sizes, keys)

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=True)
    return run.submit(NAME, parts, lambda values: [values[leader] for leader in leaders])


def handle(replica, request: UpdateRequest):
    llm = replica.llm
    batch = UpdateBatch(contexts=request.contexts, candidates=request.candidates, kwargs=request.kwargs,
                        indices=request.indices, global_size=request.global_size, replica=replica.role.replica,
                        num_replicas=llm.replicas, replica_sizes=request.replica_sizes,
                        per_sample_keys=tuple(request.per_sample))
    stats = replica.backend.update(batch)
    return stats if replica.answers else None


KIND = Kind(NAME, UpdateRequest, handle)
