"""An LLM's own world: forming it at start-up, and the tiny votes its ranks take to stay in step.

Each LLM's ranks form their own torch.distributed world (DeepSpeed's ZeRO-3, checkpoints and AutoTP
assume global rank 0 belongs to them), found through a store that the LLM's group leader hosts on its own
address and advertises in rank 0's run store. Besides the world's default group (gloo on CPU, NCCL on
GPUs) the ranks share a gloo *control group*, on which :class:`GroupChannel` takes votes: "is every rank
healthy?" before a collective training step, and "did every rank plan its share, and how many model calls
does the busiest need?" before a lockstep forward. With one rank the votes return at once.

This module does not load models or serve requests.
"""

from __future__ import annotations

import datetime
import os

import torch

from llmrl.engine.config import Config
from llmrl.engine.config.topology import RankRole
from llmrl.engine.transport import rendezvous

POSITION_SIZE = 5


class OutOfStep(RuntimeError):
    """The ranks of a group voted from different positions (see :meth:`GroupChannel.agree`); ``positions`` holds
    every rank's, in group-rank order."""

    def __init__(self, positions: list[tuple[int, ...]]):
        super().__init__(f"ranks voted from different positions: {positions}")
        self.positions = positions


class GroupChannel:
    """Votes over an LLM group's control channel (a gloo group, CPU tensors)."""

    def __init__(self, group=None, store=None):
        self.group = group
        self.store = store  # the world's store: kept referenced for the life of the process

    @property
    def size(self) -> int:
        import torch.distributed as dist

        return 1 if self.group is None else dist.get_world_size(self.group)

    def agree(self, ok: bool, value: int = 0, position: tuple[int, ...] = ()) -> tuple[bool, int]:
        """One vote: whether every rank is ``ok``, and the largest ``value``. Every vote of the group has this one
        shape (integers reduced with MAX), so that ranks at different points of a request (one voting "failed"
        after an error, another voting before its next forward) still meet in the same collective.

        ``position`` (at most :data:`POSITION_SIZE` integers) says where in its work the rank votes (the updater's
        trainer counts its calls). When every rank is ok but their positions differ, every rank raises
        :class:`OutOfStep` with all the positions, instead of going on into collectives that no longer pair up.
        """
        import torch.distributed as dist

        if self.size == 1:
            return ok, value
        if len(position) > POSITION_SIZE:
            raise ValueError(f"a vote's position has at most {POSITION_SIZE} entries, got {len(position)}")
        where = list(position) + [0] * (POSITION_SIZE - len(position))
        # max(x) and max(-x) = -min(x): positions agree when both equal.
        t = torch.tensor([0 if ok else 1, value, *where, *(-x for x in where)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        failed, most = int(t[0]), int(t[1])
        highest, lowest = t[2:2 + POSITION_SIZE], -t[2 + POSITION_SIZE:]
        if failed == 0 and not torch.equal(highest, lowest):
            mine = torch.tensor(where, dtype=torch.int64)
            every = [torch.zeros_like(mine) for _ in range(self.size)]
            dist.all_gather(every, mine, group=self.group)
            raise OutOfStep([tuple(p.tolist()) for p in every])
        return failed == 0, most

    def all_ok(self, ok: bool) -> bool:
        """True when every rank of the group passed ``ok=True``."""
        return self.agree(ok)[0]

    def sum_over_replicas(self, values: torch.Tensor, tensor_parallel: int) -> torch.Tensor:
        """The sum of ``values`` (a float64 CPU tensor, the same shape on every rank) over the LLM's replicas. The
        ``tensor_parallel`` ranks of a replica hold the same values, so the sum over all ranks is divided by it.
        Call it only right after a vote that every rank passed (ranks must meet in the same collective)."""
        import torch.distributed as dist

        if self.size == 1:
            return values.clone()
        total = values.detach().to(torch.float64).cpu().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total / tensor_parallel


def process_group_args(role: RankRole, device: torch.device, store, timeout) -> dict:
    """The arguments of ``init_process_group`` for this rank of the LLM's world: NCCL on CUDA, bound to the rank's
    own device (``device_id``: rank 0, the client, holds no GPU, so server rank k of a node sits on cuda:k-1 where
    NCCL would guess cuda:k, which can hang), gloo on CPU."""
    args = {"backend": "nccl" if device.type == "cuda" else "gloo", "store": store, "rank": role.group_rank,
            "world_size": role.group_size, "timeout": timeout}
    if device.type == "cuda":
        args["device_id"] = torch.device("cuda", device.index or 0)
    return args


def join_group(config: Config, role: RankRole, run_store, device: torch.device) -> GroupChannel:
    """Form this LLM's own torch.distributed world (plus its gloo control group); returns the control channel."""
    import torch.distributed as dist

    timeout = config.timeouts.startup
    key = rendezvous.group_key(role.llm)
    if role.is_group_leader:
        host = rendezvous.reachable_address(os.environ["MASTER_ADDR"])
        group_store = rendezvous.host_group_store(host, timeout)
        run_store.set(key, rendezvous.format_address(host, group_store.port))
    else:
        run_store.wait([key], datetime.timedelta(seconds=timeout))
        group_store = rendezvous.join_group_store(run_store.get(key).decode(), timeout)
    host, port = rendezvous.split_address(run_store.get(key).decode())
    # DeepSpeed reads these; in this process they describe the LLM's world, not the launcher's.
    os.environ.update(RANK=str(role.group_rank), WORLD_SIZE=str(role.group_size), MASTER_ADDR=host,
                      MASTER_PORT=str(port), LOCAL_RANK=str(device.index or 0))
    collective = datetime.timedelta(seconds=config.timeouts.collective)
    args = process_group_args(role, device, group_store, collective)
    dist.init_process_group(**args)
    control = dist.new_group(backend="gloo", timeout=collective) if role.group_size > 1 else None
    import deepspeed

    without_shared_memory_all_reduce(deepspeed.ops)
    deepspeed.init_distributed(dist_backend=args["backend"], auto_mpi_discovery=False, timeout=collective)
    return GroupChannel(control, group_store)


def without_shared_memory_all_reduce(ops) -> None:
    """Keep DeepSpeed (its ``deepspeed.ops`` module) from its shared-memory all-reduce: it ignores sub-groups (wrong
    tensor-parallel results) and JIT-compiles for a minute on CPU; plain gloo is right and fast enough here.

    DeepSpeed reads whether an op may be used from ``ops.__compatible_ops__``. Releases that fill it on first
    access (0.19) probe every op then, a C compiler and a linker run for some: about a CPU-second a rank, for a
    table whose only reader here (``deepspeed.comm``'s shared-memory op) asks ``.get(name, False)``. So an
    unprobed table is replaced by one that says no to that op, and a probed one is told so."""
    if "__compatible_ops__" in vars(ops):
        ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
