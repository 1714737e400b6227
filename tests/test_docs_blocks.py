"""The code in README.md and docs/ cannot rot: every YAML block is a config (or a config's section) that the schema and
the named plugins accept, every Python block compiles, and every command that names a config, a script or an example
names a file that exists. Full scripts and configs are shipped files the docs point to (their own tests run them);
``test_porting_doc.py`` checks the blocks that copy them. And a run records where and when it was measured, which
the results page shows beside its numbers.

Reference: the config loader itself (:func:`llmrl.engine.config.load_config`), Python's compiler, the file tree."""

from __future__ import annotations

import glob
import os
import re

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)])
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
SHIPPED_PATH = re.compile(r"(?<![\w./-])((?:configs|examples|benchmarks)/[\w./-]+\.(?:ya?ml|py|sh))")
OTHER_PROJECTS_FILES = {"examples/ppo_sentiments.py"}  # trlX's, which docs/porting/trlx.md ports


def blocks(language: str) -> list[tuple[str, int, str]]:
    """(page relative to the root, block number on the page, text) of every fenced block in ``language``."""
    found = []
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(open(page).read())):
            if match.group(1) in language.split("|"):
                found.append((os.path.relpath(page, ROOT), number, match.group(2)))
    return found


def ids(found):
    return [f"{page}#{number}" for page, number, _ in found]


YAML_BLOCKS = blocks("yaml|yml")


@pytest.mark.parametrize("page, number, text", YAML_BLOCKS, ids=ids(YAML_BLOCKS))
def test_every_yaml_block_is_a_valid_config_or_section(page, number, text):
    from llmrl.engine.config import load_config

    raw = yaml.safe_load(text)
    assert isinstance(raw, dict), f"{page}: a YAML block that is not a mapping"
    raw = raw if "llms" in raw else {"llms": {"main": {"model": "any/model"}}, **raw}  # a section of a config
    own_plugins = "__main__:" in text  # the script's own classes (docs/porting/lamorel.md): its test loads them
    load_config(raw=raw, check_environment=False, check_plugins=not own_plugins)


PYTHON_BLOCKS = blocks("python|py")


@pytest.mark.parametrize("page, number, text", PYTHON_BLOCKS, ids=ids(PYTHON_BLOCKS))
def test_every_python_block_compiles(page, number, text):
    compile(text, f"{page} block {number}", "exec")


def test_every_shipped_file_a_page_names_exists():
    missing = []
    for page in PAGES:
        text = open(page).read()
        for path in SHIPPED_PATH.findall(text):
            if path not in OTHER_PROJECTS_FILES and not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
    assert missing == []


def test_the_checks_find_what_they_check():
    """The patterns see the blocks and paths the pages hold (a pattern that matched nothing would pass vacuously)."""
    assert len(YAML_BLOCKS) >= 5 and len(PYTHON_BLOCKS) >= 10
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert {"configs/ppo-babyai.yaml", "examples/ppo_babyai.py"} <= set(SHIPPED_PATH.findall(readme))


def test_a_run_records_where_and_when_it_was_measured():
    """The provenance the examples write into their summary.json (and the results page shows): today's date, this
    checkout's commit (git's own answer), this machine's CPU and usable cores, the installed versions."""
    import datetime
    import subprocess

    from llmrl.engine.provenance import run_provenance

    found = run_provenance()
    assert found["date"].startswith(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert found["commit"].split("+")[0] == head.stdout.strip()
    assert found["hardware"].endswith(f", {len(os.sched_getaffinity(0))} cores")
    assert set(found["versions"]) >= {"llmrl", "torch", "transformers"}
