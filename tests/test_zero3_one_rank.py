"""ZeRO-3 in a group of one rank: a gathered call views each weight's own shard in place, without DeepSpeed's
gather (``engine/model/zero3_gather.py``). Against a copy of the model kept outside DeepSpeed, before and after a
training step: the same logits as plain PyTorch and as DeepSpeed's own gather and hooks, every weight partitioned
again after the call, also after a call that fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a DeepSpeed engine in a process of its own

SCRIPT = Path(__file__).parent / "scripts" / "zero3_one_rank.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_rank_gathered_calls_view_their_shards_exactly():
    done = subprocess.run([sys.executable, str(SCRIPT), str(free_port())], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["own_shards"], "a group of one rank should view its shards, not gather"
    assert found["partitioned_at_start"] and found["partitioned_after_call"] and found["partitioned_after_error"]
    assert found["training_moved_logits"] > 1e-3, "the training step should change the model's outputs"
    assert found["available_after_step"] > 0, "DeepSpeed should keep its small weights whole after a step"
    for key in ("gathered_vs_reference", "deepspeed_gather_vs_ours", "trained_gathered_vs_reference"):
        assert found[key] == 0.0, (key, found)  # the same weights through the same operations
    for key in ("hooked_vs_reference", "trained_hooked_vs_reference", "hooked_after_error_vs_reference"):
        assert found[key] < 1e-5, (key, found)  # DeepSpeed's hooked path runs its own linear
    assert found["gathered_calls"] == 4
