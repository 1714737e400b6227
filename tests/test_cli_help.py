"""What the ``llmrl`` command says about itself: ``--version``, ``llmrl tinker --help`` (the service's options and the
launcher's) and ``llmrl plugins --args NAME`` (a plugin's arguments). References: the installed distribution's
metadata, the parsers' options, a plugin class's own constructor and ``args_schema``."""

from __future__ import annotations

import pytest


def test_version_prints_the_installed_distributions_version(capsys):
    from importlib.metadata import version

    from llmrl.launch.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmrl {version('llmrl')}"


def test_tinker_help_lists_the_services_options_and_the_launchers_but_no_script(capsys):
    """``llmrl tinker --help`` printed ``llmrl run``'s help: --api-key-file, --port and --save-dir never showed."""
    from llmrl.launch.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["tinker", "--config", "c.yaml", "--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: llmrl tinker --config CONFIG")
    for option in ("--host", "--port", "--api-key-file", "--api-key", "--llm", "--save-dir", "--ready-file",
                   "--config", "--hostfile", "--no_ssh", "--node_rank", "--dry-run"):
        assert f"\n  {option}" in shown, option
    assert "-m MODULE" not in shown and "SCRIPT" not in shown


def test_plugins_args_prints_each_argument_with_its_schema_and_constructor_default(capsys):
    """``llmrl plugins`` listed names only; ``--args NAME`` prints what the plugin takes. Reference: the class's own
    constructor signature and ``args_schema``, read here directly."""
    import inspect

    from llmrl.launch.cli import main
    from llmrl.plugins.grpo import GRPOUpdater

    assert main(["plugins", "--args", "grpo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "updater 'grpo' (llmrl.plugins.grpo:GRPOUpdater), its args:"
    rows = {line.split()[0]: line for line in lines[2:]}
    signature = inspect.signature(GRPOUpdater.__init__).parameters
    assert set(rows) == set(signature) - {"self"} | set(GRPOUpdater.args_schema["properties"])
    for name, param in signature.items():
        if name != "self":
            assert rows[name].rstrip().endswith(repr(param.default)), rows[name]
    assert "'sequence', 'token', 'batch_token', 'fixed_length'" in rows["loss"] and ">= 1" in rows["epochs"]
    assert main(["plugins", "--args", "no_such_plugin"]) == 2
    assert "no installed plugin is named 'no_such_plugin'; installed: " in capsys.readouterr().err
