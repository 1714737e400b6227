"""The command `llmrl run` starts on one machine: DeepSpeed's per-node launcher, exactly as DeepSpeed's own runner
would start it (the runner's process start replaced by a recorder: the independent reference)."""

from __future__ import annotations

from llmrl.launch.command import RunOptions, deepspeed_command, hostfile_slots


def runner_executes(argv: list[str], monkeypatch) -> list[str]:
    """The command DeepSpeed's own runner starts for ``deepspeed argv...`` (its process start replaced by a
    recorder): the reference for :func:`node_launcher_command`."""
    import types

    import deepspeed.launcher.runner as runner

    started = []

    class Recorder:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(runner, "subprocess", types.SimpleNamespace(**{**vars(runner.subprocess), "Popen": Recorder}))
    runner.main(argv[1:])
    (cmd,) = started
    return cmd


def test_the_launcher_command_is_what_deepspeeds_runner_executes(tmp_path, monkeypatch):
    """`llmrl run` starts DeepSpeed's per-node launcher itself where the runner would only start it and wait: the
    command equals the runner's, on one machine and on one node of a hostfile run started without ssh."""
    from llmrl.launch.command import node_launcher_command

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    one = RunOptions(config="c.yaml", script="train.py", script_args=["--lr", "3"], overrides=["seed=1"],
                     master_port=1234)
    assert node_launcher_command(one, 5) == runner_executes(deepspeed_command(one, 5), monkeypatch)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=3\nnode1 slots=2\n")
    node = RunOptions(config="c.yaml", module="pkg.train", hostfile=str(hostfile), no_ssh=True, node_rank=1,
                      master_addr="10.0.0.1", master_port=29500)
    slots = hostfile_slots(hostfile.read_text())
    assert node_launcher_command(node, 5, slots) == runner_executes(deepspeed_command(node, 5), monkeypatch)
    over_ssh = RunOptions(config="c.yaml", script="s.py", hostfile=str(hostfile))
    assert node_launcher_command(over_ssh, 5, slots) is None  # pdsh: only the runner starts it
