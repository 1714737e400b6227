"""The fork server (testkit.zygote) forks a command whose PYTHONPATH is not the server's with the sys.path a fresh
``python -m`` would have (checked against fresh interpreters), and starts it afresh where that PYTHONPATH could
change where a module the server already imported comes from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testkit import live, zygote
from testkit.scripts import run_module
from testkit.zygote_paths import entries

PROBE = "llmrl_zygote_path_probe"


def fresh_path(env: dict, cwd: str, *command: str) -> list[str]:
    """``sys.path`` of a fresh interpreter ``python COMMAND`` (printing it as JSON) with ``env`` in ``cwd``."""
    out = subprocess.run([sys.executable, *command], env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def probe_folder(root) -> str:
    """A plugin folder holding a module that prints its process's sys.path."""
    folder = root / "plugins"
    folder.mkdir()
    (folder / f"{PROBE}.py").write_text("import json, sys\nprint(json.dumps(sys.path))\n")
    return str(folder)


def test_entries_are_the_ones_a_fresh_interpreter_derives(tmp_path):
    (tmp_path / "a").mkdir()
    pythonpath = os.pathsep.join(["a/", str(tmp_path / "a"), "", "rel/../b", "/nonexistent", "/nonexistent/"])
    env = {**os.environ, "PYTHONPATH": pythonpath}
    ours = entries(pythonpath, str(tmp_path))
    fresh = fresh_path(env, str(tmp_path), "-c", "import json, sys; print(json.dumps(sys.path))")
    assert fresh[0] == "" and fresh[1:1 + len(ours)] == ours
    assert ours == [str(tmp_path / "a"), str(tmp_path), str(tmp_path / "b"), "/nonexistent"]
    assert entries("", str(tmp_path)) == [] and entries(None, str(tmp_path)) == []


def test_a_pythonpath_with_a_plugin_folder_is_forked_with_a_fresh_interpreters_path(tmp_path):
    plugins = probe_folder(tmp_path)
    env = {"PYTHONPATH": os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")])}
    forked_before = zygote.STARTS["forked"]
    result = run_module(PROBE, env=env, cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert zygote.STARTS["forked"] == forked_before + 1, dict(zygote.STARTS)
    fresh = fresh_path(live.process_environment(env), str(tmp_path), "-m", PROBE)
    assert json.loads(result.stdout) == fresh
    assert fresh.index(plugins) < fresh.index(os.path.dirname(os.__file__))  # PYTHONPATH before the stdlib


@pytest.mark.parametrize("shadow", ["torch/__init__.py", "yaml.py"])
def test_a_folder_that_could_shadow_an_imported_module_is_started_afresh(tmp_path, shadow):
    plugins = probe_folder(tmp_path)
    (tmp_path / "plugins" / shadow).parent.mkdir(exist_ok=True)
    (tmp_path / "plugins" / shadow).write_text("")
    name = shadow.split("/")[0].removesuffix(".py")
    run_module(PROBE, cwd=str(tmp_path), timeout=300)  # the server runs, and has imported what it preloads
    env = {"PYTHONPATH": os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")])}
    before = dict(zygote.STARTS)
    result = run_module(PROBE, env=env, cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    started = {how: n - before.get(how, 0) for how, n in zygote.STARTS.items() if n != before.get(how, 0)}
    assert started == {f"started afresh (PYTHONPATH: {plugins} holds {name}, which the server imported already)": 1}
    assert json.loads(result.stdout) == fresh_path(live.process_environment(env), str(tmp_path), "-m", PROBE)
