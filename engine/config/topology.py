"""Who is who in a run: the role of every global rank, computed from the config alone.

Rank 0 is the client (the user's RL script). The other ranks are laid out LLM by LLM in config
order; inside an LLM, replica by replica; inside a replica, tensor-parallel rank by rank. Each LLM
forms its own torch.distributed world (its "group"), in which consecutive ranks form the
tensor-parallel groups and ranks with equal tensor-parallel rank form the data-parallel groups,
as DeepSpeed lays them out.

Pure functions only: no environment, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrl.engine.config.types import Config, LLMConfig

CLIENT_RANK = 0


@dataclass(frozen=True)
class RankRole:
    """The place of one server rank in the run."""

    global_rank: int
    llm: str
    group_rank: int  # rank inside the LLM's own world
    group_size: int  # replicas x tensor_parallel
    group_first_rank: int  # global rank of group rank 0 (the group leader)
    replica: int
    tp_rank: int
    tp_size: int

    @property
    def is_group_leader(self) -> bool:
        return self.group_rank == 0

    @property
    def is_replica_leader(self) -> bool:
        return self.tp_rank == 0


def server_roles(config: Config) -> list[RankRole]:
    """The roles of ranks 1 .. world_size-1, in rank order."""
    roles: list[RankRole] = []
    rank = 1
    for name, llm in config.llms.items():
        first = rank
        for replica in range(llm.replicas):
            for tp_rank in range(llm.tensor_parallel):
                roles.append(RankRole(
                    global_rank=rank, llm=name, group_rank=rank - first, group_size=llm.num_ranks,
                    group_first_rank=first, replica=replica, tp_rank=tp_rank, tp_size=llm.tensor_parallel,
                ))
                rank += 1
    return roles


def role_of(config: Config, global_rank: int) -> RankRole:
    if global_rank == CLIENT_RANK:
        raise ValueError("rank 0 is the client; it has no server role")
    return server_roles(config)[global_rank - 1]


def replica_ranks(config: Config, llm: str) -> list[list[int]]:
    """Global ranks of each replica of ``llm``: ``[[r0_tp0, r0_tp1], [r1_tp0, r1_tp1], ...]``."""
    out: list[list[int]] = []
    for role in server_roles(config):
        if role.llm != llm:
            continue
        if role.tp_rank == 0:
            out.append([])
        out[-1].append(role.global_rank)
    return out


def device_for(llm: LLMConfig, role: RankRole, local_rank: int, node_rank: int) -> str:
    """The torch device string of a server rank.

    ``cpu``; a GPU id from ``devices`` (one per rank of the LLM, in group-rank order); or with
    ``auto`` the rank's position among the server ranks of its node (on node 0 local rank 0 is the
    client, so server local rank L uses GPU L-1; on other nodes, GPU L).
    """
    if llm.devices == "cpu":
        return "cpu"
    if llm.devices == "auto":
        return f"cuda:{local_rank - 1 if node_rank == 0 else local_rank}"
    return f"cuda:{llm.devices[role.group_rank]}"
