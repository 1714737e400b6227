"""The documentation site: the generated reference pages are current (``python docs/generate.py``), every built-in
plugin argument has a meaning and a default, ``mkdocs build --strict`` succeeds and its API page lists every public
member of ``Caller``, and the pages speak of the code as it is, not of how it was made.

It checks the docs; it writes nothing into the repository (the site is built into a temporary folder)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "python docs/generate.py"


def _generate_module():
    spec = importlib.util.spec_from_file_location("llmrl_docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = _generate_module()


@pytest.mark.parametrize("name", sorted(GENERATE.generators()))
def test_each_generated_page_is_what_its_generator_renders(name):
    page = GENERATE.page(name)
    assert page.exists(), f"docs/reference/{name}.md is missing: run `{REGENERATE}`"
    assert page.read_text() == GENERATE.render(name), (
        f"docs/reference/{name}.md is stale (docs/generators/{name}.py renders something else): run `{REGENERATE}`")


def test_generate_check_names_a_stale_page(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(GENERATE, "REFERENCE", tmp_path)
    assert GENERATE.main(["--check"]) == 1
    assert "stale: " in capsys.readouterr().err


def test_every_builtin_plugin_argument_has_a_meaning_and_a_default():
    spec = importlib.util.spec_from_file_location("llmrl_docs_updaters", ROOT / "docs" / "generators" / "updaters.py")
    updaters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(updaters)
    plugins = updaters.builtin_plugins()
    assert {kind for kind, _, _ in plugins} == {"updater", "head", "initializer"}
    missing = [f"{kind} {name}: {row[0]} ({'no description' if not row[4] else 'no default'})"
               for kind, name, cls in plugins for row in updaters.argument_table(cls, kind)
               if not row[4] or not row[3]]
    assert missing == [], "give these arguments a `description` in the plugin's args_schema and a default (or " \
                          "mark them required in the constructor):\n" + "\n".join(missing)


def public_caller_members() -> list[str]:
    from llmrl.engine.client.caller import Caller

    return sorted(name for name in dir(Caller) if not name.startswith("_"))


@pytest.mark.slow  # a process of its own (mkdocs, 14 s): the full suite, not the unit tier
def test_the_site_builds_strictly_and_its_api_page_lists_every_public_caller_member(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    html = (site / "reference" / "api" / "index.html").read_text()
    missing = [name for name in public_caller_members()
               if f'id="llmrl.engine.client.caller.Caller.{name}"' not in html]
    assert missing == [], f"docs/reference/api.md does not render these Caller members: {missing}"


# How the project was built is not the user's business: the docs speak of the code as it is now.
FORBIDDEN = [r"\bsitting\b", r"\bthis session\b", r"\bissue #", r"\bthe machine (?:was |we were |I was )?lent\b",
             r"\blent (?:a|the) (?:machine|GPU|device)\b", r"\bdevice time\b"]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_docs_do_not_tell_how_the_project_was_built():
    found = []
    for path in doc_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in FORBIDDEN:
                if re.search(pattern, line, re.IGNORECASE):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert found == [], "the docs should describe the code as it is, not its making:\n" + "\n".join(found)
