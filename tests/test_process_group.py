"""Each server rank joins its LLM's torch.distributed world bound to its own device: on CUDA, NCCL gets the rank's
GPU as ``device_id`` (rank 0, the client, holds no GPU, so server rank k of node 0 sits on cuda:k-1, where NCCL would
guess cuda:k); on CPU, gloo and no device. Checked on data: the roles and devices a config gives, and the arguments
``init_process_group`` receives (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config import load_config
from llmrl.engine.config.topology import device_for, role_of
from llmrl.engine.server.group import process_group_args, without_shared_memory_all_reduce


def args_of(config, global_rank: int, local_rank: int, node_rank: int) -> dict:
    role = role_of(config, global_rank)
    device = torch.device(device_for(config.llms[role.llm], role, local_rank, node_rank))
    return process_group_args(role, device, store="STORE", timeout="T")


def test_every_gpu_rank_binds_nccl_to_its_own_device(tiny):
    config = load_config(raw={"llms": {"main": {"model": tiny["llama"], "replicas": 3, "devices": "auto"}}},
                         check_devices=False)
    one_node = [args_of(config, rank, local_rank=rank, node_rank=0) for rank in (1, 2, 3)]
    assert [a["device_id"] for a in one_node] == [torch.device("cuda", 0), torch.device("cuda", 1),
                                                 torch.device("cuda", 2)]
    assert [(a["backend"], a["rank"], a["world_size"], a["store"], a["timeout"]) for a in one_node] == [
        ("nccl", 0, 3, "STORE", "T"), ("nccl", 1, 3, "STORE", "T"), ("nccl", 2, 3, "STORE", "T")]
    # on a second node there is no client: local rank L is GPU L
    assert args_of(config, 3, local_rank=0, node_rank=1)["device_id"] == torch.device("cuda", 0)


def test_explicit_devices_and_cpu(tiny):
    config = load_config(raw={"llms": {"main": {"model": tiny["llama"], "replicas": 2, "devices": [5, 3]}}},
                         check_devices=False)
    assert [args_of(config, r, local_rank=r, node_rank=0)["device_id"] for r in (1, 2)] == [
        torch.device("cuda", 5), torch.device("cuda", 3)]
    cpu = load_config(raw={"llms": {"main": {"model": tiny["llama"], "replicas": 2}}})
    args = args_of(cpu, 2, local_rank=2, node_rank=0)
    assert args["backend"] == "gloo" and "device_id" not in args and args["rank"] == 1


def test_deepspeeds_shared_memory_all_reduce_is_turned_off_without_probing_every_op():
    """An unprobed table (DeepSpeed 0.19 probes on first access: a compiler run per op) is replaced, never read; a
    probed one keeps its entries. Either way DeepSpeed's one reader, ``.get("deepspeed_shm_comm", False)``, says no."""
    import types

    unprobed = types.ModuleType("ops")
    unprobed.__getattr__ = lambda name: pytest.fail(f"probed: {name} was read")
    without_shared_memory_all_reduce(unprobed)
    assert vars(unprobed)["__compatible_ops__"].get("deepspeed_shm_comm", False) is False
    probed = types.ModuleType("ops")
    probed.__compatible_ops__ = {"deepspeed_shm_comm": True, "cpu_adam": True}
    without_shared_memory_all_reduce(probed)
    assert probed.__compatible_ops__ == {"deepspeed_shm_comm": False, "cpu_adam": True}
