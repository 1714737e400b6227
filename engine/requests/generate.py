"""The ``generate`` request kind, behind ``Caller.generate``: sampled or greedy continuations with raw-model
log-probs.

Client half: contexts are split evenly across the LLM's replicas; each replica seeds its sampling with the
call's seed plus the index of its first context, so a seeded call gives the same samples whatever the
number of replicas' boundaries. Server half: the backend generates; the replica's leader answers.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from llmrl.engine.requests.base import Kind, Run, replica_parts, split_evenly

NAME = "generate"


@dataclass(frozen=True)
class GenerateRequest:
    contexts: list[str | list[int]]  # text, or token ids used as given
    kwargs: dict = field(default_factory=dict)  # Hugging Face generate arguments
    peft_adapter: str | None = None
    seed: int | None = None
    minibatch_size: int | None = None


def send(run: Run, llm: str, request: GenerateRequest) -> Future:
    bounds = split_evenly(len(request.contexts), len(run.replicas(llm)))

    def share(start: int, stop: int) -> GenerateRequest:
        seed = None if request.seed is None else request.seed + start
        return replace(request, contexts=request.contexts[start:stop], seed=seed)

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=run.config.llms[llm].lockstep)
    return run.submit(NAME, parts, lambda values: [_with_total(g) for leader in leaders for g in values[leader]])


def _with_total(samples: list[dict]) -> list[dict]:
    return [{**s, "logprob": float(s["logprobs"].sum())} for s in samples]


def handle(replica, request: GenerateRequest):
    results = replica.backend.generate(request.contexts, request.kwargs, request.peft_adapter, request.seed,
                                       request.minibatch_size)
    return results if replica.answers else None


KIND = Kind(NAME, GenerateRequest, handle)
