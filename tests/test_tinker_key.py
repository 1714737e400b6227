"""The Tinker service's key stays off the command lines of the launched processes (issue 63, point 6): every user of
the machine reads ``/proc/*/cmdline``. The key comes from ``--api-key-file`` or ``$TINKER_API_KEY``; ``--api-key K``
still works, with a warning, and ``llmrl tinker`` hands it to the ranks in their environment: the ``deepspeed``
command it runs (and each node's, for a hostfile run started node by node) never holds it. Pure: the commands are
built as data, the key read from files in a temporary folder."""

from __future__ import annotations

import argparse

import pytest

from llmrl.launch.command import deepspeed_command, hostfile_slots, node_commands
from llmrl.launch.tinker import parse_argv

KEY = "tml-secret-0123456789"


@pytest.mark.parametrize("given", [["--api-key", KEY], [f"--api-key={KEY}"]])
def test_api_key_reaches_the_ranks_environment_and_no_command_line(given, capsys, tmp_path):
    request = parse_argv(["--config", "c.yaml", "--port", "0", *given, "seed=3", "--save-dir", "d"])
    options = request.options
    assert not any(KEY in token for token in deepspeed_command(options, 2))
    assert options.script_args == ["--port", "0", "--save-dir", "d"] and options.overrides == ["seed=3"]
    assert request.env == {"TINKER_API_KEY": KEY}
    assert "--api-key shows the key in this command's line" in capsys.readouterr().err  # warned
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=2\n")
    options.hostfile, options.master_addr = str(hostfile), "node-a"
    for node in node_commands(options, hostfile_slots(hostfile.read_text())):
        assert not any(KEY in token for token in node.argv)


def test_api_key_file_travels_as_a_path_and_the_key_is_read_from_it(tmp_path, capsys):
    from llmrl.engine.tinker.serve import service_key

    file = tmp_path / "key"
    file.write_text(KEY + "\nanything after the first line\n")
    request = parse_argv(["--config", "c.yaml", "--api-key-file", str(file)])
    assert request.env == {} and request.options.script_args == ["--api-key-file", str(file)]
    assert capsys.readouterr().err == ""  # the documented way: no warning
    with pytest.raises(SystemExit, match="give the key once"):
        parse_argv(["--config", "c.yaml", "--api-key-file", str(file), "--api-key", KEY])

    def args(**given) -> argparse.Namespace:
        return argparse.Namespace(**{"api_key": None, "api_key_file": None, **given})

    assert service_key(args(api_key_file=str(file)), {"TINKER_API_KEY": "tml-other"}) == \
        (KEY, f"--api-key-file {file}")
    assert service_key(args(), {"TINKER_API_KEY": KEY}) == (KEY, "$TINKER_API_KEY")
    assert service_key(args(api_key=KEY), {"TINKER_API_KEY": "tml-other"}) == (KEY, "--api-key")
    drawn, source = service_key(args(), {})
    assert source == "drawn" and drawn.startswith("tml-") and len(drawn) > 20
    with pytest.raises(ValueError, match="--api-key-file .*missing: No such file"):
        service_key(args(api_key_file=str(tmp_path / "missing")), {})
    (tmp_path / "bad").write_text("sk-not-tinkers\n")
    with pytest.raises(ValueError, match="key of --api-key-file .* must start with 'tml-'"):
        service_key(args(api_key_file=str(tmp_path / "bad")), {})
    with pytest.raises(ValueError, match="not both"):
        service_key(args(api_key_file=str(file), api_key=KEY), {})


def test_the_run_gives_the_key_to_the_ranks_environment_and_refuses_to_send_it_over_ssh(tmp_path, capsys,
                                                                                         monkeypatch):
    """What `llmrl tinker --api-key K` runs: K in the launcher's environment, in no argument; a hostfile run started
    over ssh (pdsh puts the environment it hands on in its command line) is refused before anything starts."""
    import yaml

    import llmrl.launch.run
    from llmrl.launch.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"llms": {"main": {"model": "builtin:smollm2-135m-instruct"}}}))
    started = []
    monkeypatch.setattr(llmrl.launch.run, "prepare_builtin_models", lambda config: None)
    monkeypatch.setattr(llmrl.launch.run, "supervise", lambda cmd, env, **kw: started.append((cmd, env)) or (0, None))
    assert main(["tinker", "--config", str(config), "--api-key", KEY, "--port", "0"]) == 1  # no rank reported
    (cmd, env), = started
    assert env["TINKER_API_KEY"] == KEY and not any(KEY in token for token in cmd)
    assert main(["tinker", "--config", str(config), "--api-key", KEY, "--dry-run"]) == 0
    assert KEY not in capsys.readouterr().out
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    assert main(["tinker", "--config", str(config), "--hostfile", str(hostfile), "--api-key", KEY]) == 2
    assert "TINKER_API_KEY would reach the other nodes on pdsh's command line" in capsys.readouterr().err
    assert len(started) == 1
