"""The ``update`` request kind, behind ``Caller.update``: the LLM's updater runs on every replica, each on its share.

Client half: samples are split evenly across replicas; keyword arguments whose length equals the number of
samples are per-sample and sliced like the contexts (:func:`~llmrl.plugins.contracts.is_per_sample`), the
others reach every replica whole. Every replica takes part, even with no sample (its collectives must line
up with the others'). Server half: the backend runs the updater on an
:class:`~llmrl.plugins.contracts.UpdateBatch`; each replica's leader answers with its stats.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.requests.base import Kind, Run, replica_parts, split_evenly
from llmrl.engine.requests.finite import check_finite
from llmrl.plugins.contracts import UpdateBatch, is_per_sample

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


def send(run: Run, llm: str, contexts: list, candidates: list[list] | None, kwargs: dict) -> Future:
    check_finite(kwargs)
    n = len(contexts)
    bounds = split_evenly(n, len(run.replicas(llm)))
    sizes = [stop - start for start, stop in bounds]

    def share(start: int, stop: int) -> UpdateRequest:
        sliced = {k: (v[start:stop] if is_per_sample(v, n) else v) for k, v in kwargs.items()}
        return UpdateRequest(contexts[start:stop], None if candidates is None else candidates[start:stop], sliced,
                             list(range(start, stop)), n, sizes)

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=True)
    return run.submit(NAME, parts, lambda values: [values[leader] for leader in leaders])


def handle(replica, request: UpdateRequest):
    llm = replica.llm
    batch = UpdateBatch(contexts=request.contexts, candidates=request.candidates, kwargs=request.kwargs,
                        indices=request.indices, global_size=request.global_size, replica=replica.role.replica,
                        num_replicas=llm.replicas, replica_sizes=request.replica_sizes)
    stats = replica.backend.update(batch)
    return stats if replica.answers else None


KIND = Kind(NAME, UpdateRequest, handle)
