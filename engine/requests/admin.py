"""Small request kinds that need no model: ``setup`` (build every rank's engine with the script's plugins),
``ping`` (a minimal round trip) and ``stats`` (memory per rank, what its host allocator was told, and how many
requests of each kind it received).

``setup`` is sent once, by the Caller's constructor, to every server rank; each LLM's first rank answers with
the LLM's description. ``ping`` and ``stats`` are served even before setup.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.requests.base import Kind, Run, every_rank
from llmrl.engine.server import host_memory

SETUP, PING, STATS = "setup", "ping", "stats"


@dataclass(frozen=True)
class SetupRequest:
    plugins: dict = field(default_factory=dict)  # {llm: {"heads": {...}, "initializers": [...], "updater": spec}}


@dataclass(frozen=True)
class PingRequest:
    pass


@dataclass(frozen=True)
class StatsRequest:
    pass


def send_setup(run: Run, plugins: dict, roles: dict) -> Future:
    return run.submit(SETUP, [(every_rank(run), SetupRequest(plugins))],
                      lambda values: {roles[r].llm: v for r, v in sorted(values.items()) if v is not None})


def send_ping(run: Run, rank: int) -> Future:
    return run.submit(PING, [([rank], PingRequest())], lambda values: values[rank])


def send_stats(run: Run) -> Future:
    return run.submit(STATS, [(every_rank(run), StatsRequest())], lambda values: dict(sorted(values.items())))


def handle_setup(replica, request: SetupRequest):
    return replica.setup(request.plugins.get(replica.llm.name, {}))


def handle_ping(replica, request: PingRequest):
    return {"rank": replica.role.global_rank}


def handle_stats(replica, request: StatsRequest):
    import torch

    return {**replica.backend.memory(request), "host_allocator": host_memory.report(),
            "requests": dict(replica.handled), "threads": torch.get_num_threads()}


KINDS = (Kind(name=SETUP, payload=SetupRequest, send=send_setup, handle=handle_setup, backend_method=None,
              caller_methods=("__init__",), needs_setup=False),
         Kind(name=PING, payload=PingRequest, send=send_ping, handle=handle_ping, backend_method=None,
              caller_methods=("ping",), needs_setup=False),
         Kind(name=STATS, payload=StatsRequest, send=send_stats, handle=handle_stats, backend_method="memory",
              caller_methods=("server_memory",), needs_setup=False))
