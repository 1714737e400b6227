"""The ``state_dict`` request kind, behind ``Caller.state_dict``: an LLM's weights as CPU tensors.

Client half: every rank of the LLM takes part (ZeRO-3 partitions and tensor-parallel shards are gathered
collectively), or only the ranks of one replica for that replica's own copy; the first of them answers.
Server half: the backend gathers (or copies) and filters by prefix.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.requests.base import Kind, Run, every_rank

NAME = "state_dict"


@dataclass(frozen=True)
class StateDictRequest:
    prefix: str = ""
    own_replica: bool = False  # this replica's own copy instead of the gathered whole


def send(run: Run, llm: str, prefix: str, replica: int | None) -> Future:
    if replica is None:
        ranks = every_rank(run, [llm])
    else:
        replicas = run.replicas(llm)
        if not 0 <= replica < len(replicas):
            raise InvalidArgument(f"replica must be in 0..{len(replicas) - 1} for LLM {llm!r}, got {replica}")
        ranks = replicas[replica]
    request = StateDictRequest(prefix, own_replica=replica is not None)
    return run.submit(NAME, [(ranks, request)], lambda values: values[ranks[0]])


def handle(replica, request: StateDictRequest):
    return replica.backend.state_dict(request)


KIND = Kind(name=NAME, payload=StateDictRequest, send=send, handle=handle, backend_method="state_dict",
            caller_methods=("state_dict",))
