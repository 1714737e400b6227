"""The launcher's command and the rank entry point's arguments, as data."""

from __future__ import annotations

import base64
import json
import os
import signal

import pytest

from llmrl.launch.command import RunOptions, deepspeed_command, hostfile_slots
from llmrl.launch.rank import parse_rank_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_machine_command_counts_the_ranks():
    options = RunOptions(config="c.yaml", script="train.py", script_args=["--lr", "3"], overrides=["seed=1"],
                         master_port=1234)
    assert deepspeed_command(options, 5) == [
        "deepspeed", "--num_gpus", "5", "--master_port", "1234", "--log_level", "error", "--module", "llmrl.launch",
        "--config", "c.yaml",
        "seed=1", "train.py", "--lr", "3"]


def test_multi_node_command_without_ssh():
    options = RunOptions(config="c.yaml", module="pkg.train", hostfile="hosts", no_ssh=True, node_rank=1,
                         master_addr="10.0.0.1", master_port=29500)
    assert deepspeed_command(options, 5) == [
        "deepspeed", "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1",
        "--master_port", "29500", "--log_level", "warning", "--module", "llmrl.launch", "--config", "c.yaml",
        "-m", "pkg.train"]


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


# ----------------------------------------------------------------------------- several nodes (SLURM, --dry-run)


def test_node_commands_of_a_two_node_four_rank_allocation():
    """What `srun` starts on each node of a 2-node allocation with 2 slots each (examples/slurm/)."""
    from llmrl.launch.command import node_commands

    options = RunOptions(config="c.yaml", script="train.py", script_args=["--steps", "3"], overrides=["seed=1"],
                         hostfile="hosts", master_addr="gpu-a01")
    nodes = node_commands(options, {"gpu-a01": 2, "gpu-a02": 2})
    assert [(n.host, n.node_rank, list(n.ranks)) for n in nodes] == [("gpu-a01", 0, [0, 1]), ("gpu-a02", 1, [2, 3])]
    for node in nodes:
        assert node.argv == [
            "deepspeed", "--hostfile", "hosts", "--no_ssh", "--node_rank", str(node.node_rank),
            "--master_addr", "gpu-a01", "--master_port", "29500", "--log_level", "warning",
            "--module", "llmrl.launch", "--config", "c.yaml", "seed=1", "train.py", "--steps", "3"]
    # Without --master_addr, node 0 is the first host of the hostfile (as DeepSpeed assumes).
    second = node_commands(RunOptions(config="c.yaml", script="s.py", hostfile="h", master_port=7), {"a": 3, "b": 1})[1]
    assert second.argv[3:9] == ["--no_ssh", "--node_rank", "1", "--master_addr", "a", "--master_port"]


def test_node_ranks_follow_the_hostfile_order():
    from llmrl.launch.command import node_ranks

    slots = {"a": 3, "b": 1, "c": 2}
    assert [list(node_ranks(slots, r)) for r in range(3)] == [[0, 1, 2], [3], [4, 5]]
    with pytest.raises(ValueError, match="node_rank 3 is out of range: the hostfile names 3 node"):
        node_ranks(slots, 3)


def _config_with(tmp_path, ranks: int, **llm) -> str:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"llms": {"main": {"model": "builtin:smollm2-135m-instruct",
                                                      "replicas": ranks - 1, **llm}}}))
    return str(path)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if anything tries to start a process."""
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    import llmrl.launch.run

    monkeypatch.setattr(llmrl.launch.run, "supervise", refuse)


def script_here(folder, monkeypatch, name: str) -> None:
    """Work in ``folder``, where a script ``name`` exists (`llmrl run` refuses a script that is not a file)."""
    monkeypatch.chdir(folder)
    (folder / name).write_text("")


def test_dry_run_prints_every_nodes_command(tmp_path, capsys, nothing_starts, monkeypatch):
    from llmrl.launch.cli import main

    script_here(tmp_path, monkeypatch, "train.py")

    config = _config_with(tmp_path, 4)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-a01 slots=2\ngpu-a02 slots=2\n")
    code = main(["run", "--config", config, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1",
                 "--master_addr", "10.1.2.3", "--master_port", "29999", "--dry-run", "train.py", "--lr", "3"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line.split() for line in lines if not line.startswith("#")]
    assert len(commands) == 2
    for rank, cmd in enumerate(commands):
        assert cmd[0].endswith("deepspeed")
        assert cmd[1:] == ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank), "--master_addr",
                           "10.1.2.3", "--master_port", "29999", "--log_level", "warning", "--module", "llmrl.launch",
                           "--config", config, "train.py", "--lr", "3"]
    notes = [line for line in lines if line.startswith("#")]
    assert "# node 0, gpu-a01, ranks 0-1, rank 0 runs the script:" in notes
    assert "# node 1, gpu-a02, ranks 2-3 (this command):" in notes


def test_dry_run_refuses_what_the_run_would_refuse(tmp_path, capsys, nothing_starts, monkeypatch):
    from llmrl.launch.cli import main

    assert main(["run", "--config", _config_with(tmp_path, 4), "--dry-run", "s.py"]) == 2  # checked, not started
    assert "the script s.py is not a file" in capsys.readouterr().err
    script_here(tmp_path, monkeypatch, "s.py")

    config = _config_with(tmp_path, 4)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=1\n")
    assert main(["run", "--config", config, "--hostfile", str(hostfile), "--dry-run", "s.py"]) == 2
    assert "offers 3 slots but the config needs 4 ranks" in capsys.readouterr().err
    hostfile.write_text("a slots=2\nb slots=2\n")
    assert main(["run", "--config", config, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "2",
                 "--master_addr", "a", "--dry-run", "s.py"]) == 2
    assert "node_rank 2 is out of range" in capsys.readouterr().err


# ----------------------------------------------------------------------------- `llmrl run`'s command line


ORDERS = {
    "options first": ["--config", "c.yaml", "--hostfile", "h", "--no_ssh", "--node_rank", "1", "--master_addr",
                      "10.0.0.1", "--master_port", "29500", "llms.policy.model=X", "script.py", "--lr", "3"],
    "override between options": ["--config", "c.yaml", "llms.policy.model=X", "--hostfile", "h", "--no_ssh",
                                 "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29500",
                                 "script.py", "--lr", "3"],
    "config last, = forms": ["llms.policy.model=X", "--hostfile=h", "--no-ssh", "--node-rank=1",
                             "--master-addr=10.0.0.1", "--master_port=29500", "--config=c.yaml", "script.py",
                             "--lr", "3"],
}


@pytest.mark.parametrize("order", ORDERS)
def test_launcher_options_and_overrides_in_any_order_before_the_script(order):
    from llmrl.launch.run import parse_argv

    request = parse_argv(ORDERS[order])
    assert request.options == RunOptions(config="c.yaml", script="script.py", script_args=["--lr", "3"],
                                         overrides=["llms.policy.model=X"], hostfile="h", master_addr="10.0.0.1",
                                         master_port=29500, no_ssh=True, node_rank=1)
    assert not request.dry_run


def test_everything_after_the_script_is_the_scripts():
    from llmrl.launch.run import parse_argv

    options = parse_argv(["--config", "c.yaml", "s.py", "--hostfile", "x", "a=1", "--dry-run"]).options
    assert (options.script, options.script_args, options.hostfile, options.overrides) == (
        "s.py", ["--hostfile", "x", "a=1", "--dry-run"], None, [])
    options = parse_argv(["--config", "c.yaml", "a=1", "-m", "pkg.train", "--config", "x"]).options
    assert (options.module, options.script, options.script_args, options.overrides) == (
        "pkg.train", None, ["--config", "x"], ["a=1"])


@pytest.mark.parametrize("argv,words", [
    (["--config", "c.yaml", "--hostfil", "h", "s.py"],
     "unknown option '--hostfil' before the script; did you mean --hostfile?"),
    (["--config", "c.yaml", "--dryrun", "s.py"], "did you mean --dry-run?"),  # the documented spelling, not its alias
    (["--config", "c.yaml", "--master_port"], "--master_port needs a value"),
    (["--config", "c.yaml", "--no_ssh=1", "s.py"], "--no_ssh takes no value"),
    (["--hostfile", "h", "s.py"], "--config CONFIG is required"),
    (["--config", "c.yaml", "a=1"], "give the client script"),
    (["--config", "c.yaml", "--node_rank", "1", "s.py"], "--node_rank goes with --no_ssh"),
    (["--config", "c.yaml", "--master_port", "many", "s.py"], "invalid int value: 'many'"),
])
def test_a_wrong_command_line_is_refused_before_anything_starts(argv, words, capsys, nothing_starts):
    from llmrl.launch.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["run", *argv])
    assert stop.value.code == 2
    assert words in capsys.readouterr().err


def test_the_issue_command_line_reaches_the_launcher_whole(tmp_path, capsys, monkeypatch):
    """An override before --hostfile used to push --hostfile into the script's arguments and start every rank on
    one machine; now the command run is the hostfile run of node 1."""

    from llmrl.launch.cli import main

    script_here(tmp_path, monkeypatch, "script.py")
    config = _config_with(tmp_path, 5)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=3\nnode1 slots=2\n")
    started = []

    def supervise(cmd, env, script_ended=None, servers_unreached=None):
        started.append((cmd, env))
        assert script_ended is None  # rank 0 runs on node 0: this node cannot tell when the script ended
        return 0, None

    import llmrl.launch.run

    prepared = []

    def prepare(config_obj):  # builtin models are made ready before the launcher starts (built for real, in an
        assert not started    # empty cache, by test_launch_live's test_llmrl_run and test_builtin_smollm2)
        prepared.append(config_obj.llms["main"].model)
        return None

    monkeypatch.setattr(llmrl.launch.run, "prepare_builtin_models", prepare)
    monkeypatch.setattr(llmrl.launch.run, "supervise", supervise)
    argv = ["run", "--config", config, "seed=4", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1",
            "--master_addr", "10.0.0.1", "--master_port", "29500", "script.py", "--x"]
    monkeypatch.delenv("LLMRL_RUN_SECRET", raising=False)
    assert main(argv) == 2 and not started  # nodes started one by one need the user's shared secret
    assert "needs the same LLMRL_RUN_SECRET on every node" in capsys.readouterr().err
    monkeypatch.setenv("LLMRL_RUN_SECRET", "ab" * 32)
    main(argv)
    assert prepared[-1] == "builtin:smollm2-135m-instruct"
    (cmd, env), = started
    world = json.loads(base64.urlsafe_b64decode(cmd[4].split("=", 1)[1]))  # the hostfile's, node 1 started here
    assert cmd[3] == "deepspeed.launcher.launch" and world == {"node0": [0, 1, 2], "node1": [0, 1]}
    assert cmd[5:8] == ["--master_addr=10.0.0.1", "--master_port=29500", "--node_rank=1"]
    assert cmd[-4:] == [config, "seed=4", "script.py", "--x"]
    assert env["LLMRL_RUN_PID"] == str(os.getpid()) and env["LLMRL_RUN_SECRET"] == "ab" * 32


def test_run_refuses_a_gpu_config_without_gpus_and_validate_notes_it(capsys, nothing_starts, tmp_path, monkeypatch):
    import torch

    from llmrl.launch.cli import main

    script_here(tmp_path, monkeypatch, "s.py")

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    gpu = os.path.join(ROOT, "configs", "gpu.yaml")
    assert main(["run", "--config", gpu, "--dry-run", "s.py"]) == 2
    assert "llms.policy.devices: 'auto' asks for GPUs but CUDA is not available" in capsys.readouterr().err
    assert main(["validate", gpu]) == 0
    out = capsys.readouterr().out
    assert "valid. The run needs 5 ranks" in out and "note: llms.policy.devices: auto asks for GPUs" in out
    overrides = ["llms.policy.training.optimizer.lr=3e-5", "llms.policy.initializers.0.args.adapters.default.r=4"]
    assert main(["validate", gpu, *overrides]) == 0  # the merged config is shown, list items and 1e-5 numbers set
    shown = capsys.readouterr().out.split("merged config")[1]
    assert "      lr: 3.0e-05\n" in shown and "            r: 4\n" in shown
    assert main(["validate", gpu, "--strict-devices", "seed=3"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert main(["validate", "seed=5", "--config", gpu]) == 0  # --config as in llmrl run, overrides on either side
    assert "\n  seed: 5\n" in capsys.readouterr().out.split("merged config")[1]


# ----------------------------------------------------------------------------- the run's exit code


@pytest.mark.parametrize("launcher,stopped_by,reported,expected", [
    (0, None, {0: 3, 1: 0}, 3),  # rank 0 here: the script's code
    (1, None, {0: 0, 1: None}, 0),  # the script's code even if a server then failed
    (0, None, {2: 0, 3: 0}, 0),  # node 1, every rank stopped cleanly
    (0, None, {2: 0, 3: None}, 1),  # node 1, its DeepSpeed launcher was killed (and said 0)
    (1, None, {2: None}, 1),
    (-9, None, {2: None}, 137),
    (247, None, {0: None, 1: 0}, 137),  # DeepSpeed's launcher reports a rank killed by SIGKILL with sys.exit(-9)
    (247, None, {0: 143, 1: None, 2: 0}, 137),  # a server killed by SIGKILL, then the script stopped by the launcher
    (247, None, {0: 1, 1: None}, 1),  # the script failed on its own (its call raised): its code
    (143, None, {0: 143, 1: 0}, 143),  # the script itself was sent SIGTERM: the launcher passes its code on
    (200, None, {0: None}, 184),  # a real-time signal (56), which has no name
    (255, None, {}, 255),  # over ssh no rank reports here: a code is the script's code (sys.exit(-1), pdsh's 255)
    (255, None, {2: 0, 3: 0}, 255),
    (1, signal.SIGINT, {0: None, 1: None}, 130),  # Ctrl-C
    (1, signal.SIGINT, {0: 143, 1: None}, 130),  # Ctrl-C that the launcher turned into SIGTERM on rank 0
    (1, signal.SIGINT, {0: 130}, 130),
    (1, signal.SIGTERM, {0: 143}, 143),
    (0, signal.SIGTERM, {0: None}, 143),
])
def test_run_exit_code(launcher, stopped_by, reported, expected):
    from llmrl.launch.run import run_exit_code

    assert run_exit_code(launcher, stopped_by, reported) == expected


def test_local_ranks():
    from llmrl.launch.run import local_ranks

    slots = {"a": 2, "b": 3}
    assert local_ranks(RunOptions(config="c"), 4, None) == [0, 1, 2, 3]
    assert local_ranks(RunOptions(config="c", hostfile="h", no_ssh=True, node_rank=1), 5, slots) == [2, 3, 4]
    assert local_ranks(RunOptions(config="c", hostfile="h"), 5, slots) == []  # over ssh: ranks report remotely


def test_a_loopback_master_across_nodes_is_warned_about():
    from llmrl.launch.rank import loopback_master_warning

    debian = {"node0": "127.0.1.1", "node0.cluster": "10.0.0.5"}.__getitem__
    message = loopback_master_warning({"MASTER_ADDR": "node0", "CROSS_SIZE": "2"}, resolve=debian)
    assert "spans 2 nodes but MASTER_ADDR 'node0' is the loopback address 127.0.1.1" in message
    assert loopback_master_warning({"MASTER_ADDR": "node0.cluster", "CROSS_SIZE": "2"}, resolve=debian) is None
    assert loopback_master_warning({"MASTER_ADDR": "node0", "CROSS_SIZE": "1"}, resolve=debian) is None


@pytest.mark.skipif(not os.path.exists("/proc/net"), reason="Linux interface names")
def test_gloo_is_pinned_to_the_interface_on_the_route_to_the_master():
    from llmrl.engine.transport.rendezvous import interface_of
    from llmrl.launch.rank import pin_gloo_interface

    environ = {"MASTER_ADDR": "127.0.0.1"}
    assert pin_gloo_interface(environ) == "lo" and environ["GLOO_SOCKET_IFNAME"] == "lo"
    chosen = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth7"}
    assert pin_gloo_interface(chosen) is None and chosen["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice stays
    assert interface_of("198.51.100.7") is None  # TEST-NET-2: held by no interface here


def test_llmrl_tinker_hands_its_own_options_to_the_service_and_the_rest_to_llmrl_run():
    from llmrl.launch.tinker import MODULE, parse_argv, split_service_options

    rest, service = split_service_options(["--config", "c.yaml", "--port", "0", "seed=3", "--api-key=tml-k",
                                           "--master_port", "29600"])
    assert rest == ["--config", "c.yaml", "seed=3", "--master_port", "29600"]
    assert service == ["--port", "0", "--api-key=tml-k"]
    request = parse_argv(["--config", "c.yaml", "--port", "0", "llms.main.replicas=2"])
    assert request.options.module == MODULE and request.options.script_args == ["--port", "0"]
    assert request.options.overrides == ["llms.main.replicas=2"]


def test_every_verb_without_a_parser_of_its_own_runs_from_the_command(capsys):
    """`llmrl plugins`, `env` and `--help` go through the one argparse parser, which lists every verb."""
    from llmrl.launch.cli import VERBS, main

    assert main(["plugins"]) == 0
    listed = capsys.readouterr().out
    for updater in ("ppo_tokens", "grpo", "lora", "token_value"):
        assert updater in listed
    assert main(["env"]) == 0
    assert "deepspeed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    usage = capsys.readouterr().out
    for verb in VERBS:
        assert verb in usage

