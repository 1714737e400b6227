"""The launcher's command and the rank entry point's arguments, as data."""

from __future__ import annotations

import pytest

from llmrl.launch.command import RunOptions, deepspeed_command, hostfile_slots
from llmrl.launch.rank import parse_rank_args


def test_single_machine_command_counts_the_ranks():
    options = RunOptions(config="c.yaml", script="train.py", script_args=["--lr", "3"], overrides=["seed=1"],
                         master_port=1234)
    assert deepspeed_command(options, 5) == [
        "deepspeed", "--num_gpus", "5", "--master_port", "1234", "--log_level", "warning", "--module", "llmrl.launch", "--config", "c.yaml",
        "seed=1", "train.py", "--lr", "3"]


def test_multi_node_command_without_ssh():
    options = RunOptions(config="c.yaml", module="pkg.train", hostfile="hosts", no_ssh=True, node_rank=1,
                         master_addr="10.0.0.1", master_port=29500)
    assert deepspeed_command(options, 5) == [
        "deepspeed", "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1",
        "--master_port", "29500", "--log_level", "warning", "--module", "llmrl.launch", "--config", "c.yaml", "-m", "pkg.train"]


def test_hostfile_slots():
    assert hostfile_slots("# comment\nnode0 slots=3\n\nnode1 slots=2\n") == {"node0": 3, "node1": 2}
    with pytest.raises(ValueError, match="line 1"):
        hostfile_slots("node0 gpus=3")


def test_rank_arguments_drop_the_launchers_local_rank():
    args = parse_rank_args(["--local_rank=3", "--config", "c.yaml", "a.b=1", "script.py", "--x", "k=v"])
    assert (args.local_rank, args.config, args.overrides, args.script) == (3, "c.yaml", ["a.b=1"], "script.py")
    assert args.script_args == ["--x", "k=v"]
    args = parse_rank_args(["--config=c.yaml", "-m", "pkg.mod", "--local_rank=1"])
    assert args.module == "pkg.mod" and args.script_args == ["--local_rank=1"]


@pytest.mark.parametrize("argv,message", [
    (["script.py"], "--config CONFIG is required"),
    (["--config", "c.yaml"], "no script given"),
    (["--config", "c.yaml", "--bogus", "s.py"], "unknown option '--bogus'"),
])
def test_bad_rank_arguments(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_rank_args(argv)
