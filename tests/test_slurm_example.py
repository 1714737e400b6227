"""examples/slurm/llmrl.sbatch on a simulated 2-node, 4-rank allocation: `scontrol` and `srun` are stand-ins
(srun runs the task once per node with its SLURM_NODEID) and `llmrl` records its command line. The recorded
command of each node must be the `llmrl run --no_ssh --node_rank R` of that node, and the deepspeed command it
would run must be node R's line of the dry run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import yaml

from llmrl.launch.command import hostfile_slots, node_commands
from llmrl.launch.run import parse_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "examples", "slurm", "llmrl.sbatch")
STUBS = {
    "scontrol": '#!/bin/bash\n[ "$1 $2 $3" = "show hostnames gpu-a[01-02]" ] && printf "gpu-a01\\ngpu-a02\\n"\n',
    # srun: drop its own options, run the task once per node of the allocation.
    "srun": ('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
             'for id in 0 1; do SLURM_NODEID=$id "$@" || exit; done\n'),
    "llmrl": f'#!{sys.executable}\nimport json, os, sys\n'
             'with open(os.environ["RECORD"], "a") as f:\n'
             '    f.write(json.dumps({"node": os.environ.get("SLURM_NODEID"), "argv": sys.argv[1:], '
             '"secret": os.environ.get("LLMRL_RUN_SECRET")}) + "\\n")\n',
}


def stub(directory, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="runs the batch script with bash")
def test_the_sbatch_script_starts_one_llmrl_run_per_node(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        stub(bin_dir, name, text)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"llms": {"main": {"model": "builtin:smollm2-135m-instruct", "replicas": 3}}}))
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_JOB_ID": "4242", "CONFIG": str(config),
           "SCRIPT": "train.py", "SCRIPT_ARGS": "--steps 3", "SLOTS": "2", "LLMRL": "llmrl",
           "HOSTFILE": str(tmp_path / "users-hosts")}  # an inherited HOSTFILE: the user's own file, never written
    (tmp_path / "users-hosts").write_text("big1 slots=8\n")
    result = subprocess.run(["bash", SBATCH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "users-hosts").read_text() == "big1 slots=8\n"
    hostfile = tmp_path / "llmrl-hostfile.4242"
    assert hostfile.read_text() == "gpu-a01 slots=2\ngpu-a02 slots=2\n"
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    # the job's hostfile name taken already (not by this job): refused, the file kept
    again = subprocess.run(["bash", SBATCH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists and this job did not write it" in again.stderr
    assert hostfile.read_text() == "gpu-a01 slots=2\ngpu-a02 slots=2\n"
    assert [c["node"] for c in calls] == [None, "0", "1"]  # the dry run on the batch host, then one per node
    secrets = {c["secret"] for c in calls}
    assert len(secrets) == 1 and len(secrets.pop() or "") == 64  # every node holds the same run secret
    assert calls[0]["argv"][0] == "run" and "--dry-run" in calls[0]["argv"]
    expected = node_commands(parse_argv(calls[0]["argv"][1:]).options, hostfile_slots(hostfile.read_text()))
    for node, call in enumerate(calls[1:]):
        assert call["argv"][0] == "run"
        options = parse_argv(call["argv"][1:]).options
        assert (options.no_ssh, options.node_rank, options.master_addr, options.master_port) == (
            True, node, "gpu-a01", 20000 + 4242)
        assert (options.script, options.script_args, options.hostfile) == ("train.py", ["--steps", "3"], str(hostfile))
        assert node_commands(options, hostfile_slots(hostfile.read_text()))[node] == expected[node]
    # The batch host's dry run, for real: it checks the config and slots and prints both nodes' commands.
    from llmrl.launch.cli import main

    monkeypatch.setattr(subprocess, "Popen", None)  # nothing may start
    monkeypatch.chdir(tmp_path)  # where the job's script is (llmrl run refuses a script that is not a file)
    (tmp_path / "train.py").write_text("")
    capsys.readouterr()
    assert main(calls[0]["argv"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [line.split()[1:] for line in printed] == [node.argv[1:] for node in expected]


def test_the_sbatch_script_refuses_slots_that_do_not_match_the_nodes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        stub(bin_dir, name, text)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD": str(tmp_path / "r"),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_JOB_ID": "1", "CONFIG": "c.yaml", "SCRIPT": "s.py",
           "SLOTS": "3 1 1"}
    result = subprocess.run(["bash", SBATCH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "SLOTS gives 3 numbers but the job has 2 nodes" in result.stderr
    assert not (tmp_path / "r").exists()
