"""Checkpoint swaps (client side, with a stand-in for the servers): a save never replaces anything that is not an
llmrl checkpoint, a crash between the two renames of the swap leaves a checkpoint a run can resume from (and the
next save cleans up), and the newest backup is chosen by the time its manifest records."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path

import pytest

from llmrl.engine.checkpoint_layout import MANIFEST, resolve_checkpoint
from llmrl.engine.client import saving
from llmrl.engine.config import load_config
from llmrl.engine.errors import ConfigError, InvalidArgument


class FakeRun:
    """Stands for the run: its 'servers' write one file per LLM into the staging folder they are given."""

    def __init__(self, tiny):
        self.config = load_config(raw={"llms": {"main": {"model": tiny["llama"]}}}, check_plugins=False)
        self.saves = 0
        self.closed_llms = set()

    def replicas(self, llm):
        return [[1]]

    def submit(self, kind, parts, assemble):
        ((ranks, request),) = parts
        self.saves += 1
        folder = Path(request.folder) / "main" / "export"
        folder.mkdir(parents=True)
        (folder / "weights.txt").write_text(f"save {self.saves}")
        future = Future()
        future.set_result(None)
        return future


def save(run, path):
    return saving.save_run(run, lambda future: future.result(), str(path))


def weights(path) -> str:
    return (Path(path) / "main" / "export" / "weights.txt").read_text()


def test_a_save_writes_a_manifest_of_its_entries_and_replaces_only_its_own_kind(tiny, tmp_path):
    run = FakeRun(tiny)
    target = tmp_path / "ckpt"
    save(run, target)
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["entries"] == sorted(["main", MANIFEST]) and manifest["llms"] == ["main"]
    save(run, target)
    assert weights(target) == "save 2"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging folder or backup left


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tiny, tmp_path):
    run = FakeRun(tiny)
    experiment = tmp_path / "runs" / "exp"
    experiment.mkdir(parents=True)
    (experiment / "metrics.csv").write_text("update,reward\n1,0.5\n")
    with pytest.raises(InvalidArgument, match="not empty and not an llmrl checkpoint.*metrics.csv"):
        save(run, experiment)
    assert (experiment / "metrics.csv").read_text() == "update,reward\n1,0.5\n"
    cwd = os.getcwd()
    os.chdir(experiment)
    try:  # save(".") would have replaced the working folder
        with pytest.raises(InvalidArgument, match="not an llmrl checkpoint"):
            save(run, ".")
    finally:
        os.chdir(cwd)
    assert sorted(os.listdir(experiment)) == ["metrics.csv"] and run.saves == 0
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(InvalidArgument, match="it is a file"):
        save(run, tmp_path / "a-file")


def test_a_checkpoint_holding_a_file_of_yours_is_not_replaced(tiny, tmp_path):
    run = FakeRun(tiny)
    target = tmp_path / "ckpt"
    save(run, target)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="also holds 'notes.txt'"):
        save(run, target)
    assert (target / "notes.txt").read_text() == "mine" and weights(target) == "save 1"
    (target / "notes.txt").unlink()
    for inside in (target / "main" / "NOTES.txt", target / "main" / "export" / "my_eval_results.json"):
        inside.write_text("mine")  # inside the checkpoint's own folders: they went with the next save
        with pytest.raises(InvalidArgument, match=f"also holds '{inside.relative_to(target).as_posix()}'"):
            save(run, target)
        assert inside.read_text() == "mine" and weights(target) == "save 1"
        inside.unlink()
    save(run, target)
    assert weights(target) == "save 2"


def test_a_crash_between_the_two_renames_leaves_a_resumable_checkpoint(tiny, tmp_path, monkeypatch):
    run = FakeRun(tiny)
    target = tmp_path / "ckpt"
    save(run, target)
    real_rename = os.rename
    calls = []

    def crash_on_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(saving.os, "rename", crash_on_second_rename)
    with pytest.raises(OSError, match="power cut"):
        save(run, target)
    monkeypatch.setattr(saving.os, "rename", real_rename)
    assert not target.exists()
    backup = resolve_checkpoint(target)
    assert backup.name.startswith(".ckpt.old-") and weights(backup) == "save 1"
    config = {"llms": {"main": {"model": tiny["llama"], "checkpoint": str(target)}}}
    assert load_config(raw=config, check_plugins=False).llms["main"].checkpoint == str(target)  # resumable
    save(run, target)
    assert weights(target) == "save 3" and sorted(os.listdir(tmp_path)) == ["ckpt"]  # the stale backup is gone


def test_the_newest_backup_is_chosen_by_its_manifest_not_its_folder_time(tmp_path):
    for name, when in (("old-a", 100.0), ("old-b", 200.0)):
        folder = tmp_path / f".ckpt.{name}"
        folder.mkdir()
        (folder / MANIFEST).write_text(json.dumps({"time": when, "llms": []}))
    os.utime(tmp_path / ".ckpt.old-a", (10**9 + 50, 10**9 + 50))  # the older save has the newer folder time
    os.utime(tmp_path / ".ckpt.old-b", (10**9, 10**9))
    assert resolve_checkpoint(tmp_path / "ckpt").name == ".ckpt.old-b"
    with pytest.raises(ConfigError, match="does not exist or is not complete"):
        load_config(raw={"llms": {"main": {"model": "org/name", "checkpoint": str(tmp_path / "other")}}},
                    check_environment=False, check_plugins=False)


def test_a_checkpoint_name_with_glob_characters_touches_only_its_own_backups(tiny, tmp_path):
    """``run[12]`` as a glob pattern matches ``.run1.old-*``: another checkpoint's backup, which a save of ``run[12]``
    deleted and a resume of ``run[12]`` took for its own. Names are matched literally."""
    other = tmp_path / ".run1.old-abc"
    other.mkdir()
    (other / MANIFEST).write_text(json.dumps({"time": 100.0, "llms": []}))
    staging = tmp_path / ".run1.staging-abc"  # another save in progress
    staging.mkdir()
    with pytest.raises(ConfigError, match="does not exist or is not complete"):
        load_config(raw={"llms": {"main": {"model": tiny["llama"], "checkpoint": str(tmp_path / "run[12]")}}},
                    check_plugins=False)
    save(FakeRun(tiny), tmp_path / "run[12]")
    assert other.is_dir() and staging.is_dir() and weights(tmp_path / "run[12]") == "save 1"


def test_a_resumed_client_draws_the_generate_seeds_the_saved_run_would_have_drawn_next(tiny, tmp_path):
    """``generate`` without a seed takes one from the client's generator: saved with the checkpoint, a resumed run
    goes on with the seeds after the save's, instead of drawing the first ones again."""
    import random

    config = load_config(raw={"llms": {"main": {"model": tiny["llama"]}}, "seed": 5}, check_plugins=False)
    seeds = saving.generate_seeds(config)
    assert seeds.getstate() == random.Random(5).getstate()  # no checkpoint: the config's seed
    before = [seeds.randrange(2**31) for _ in range(3)]
    saving.save_run(FakeRun(tiny), lambda future: future.result(), str(tmp_path / "ckpt"), seeds)
    uninterrupted = [seeds.randrange(2**31) for _ in range(3)]
    resumed = load_config(raw={"llms": {"main": {"model": tiny["llama"], "checkpoint": str(tmp_path / "ckpt")}},
                               "seed": 5}, check_plugins=False)
    again = saving.generate_seeds(resumed)
    assert [again.randrange(2**31) for _ in range(3)] == uninterrupted != before


def test_a_resumed_run_tracks_its_steps_after_the_saved_ones(tiny, tmp_path):
    """A named run's files are appended to: the resumed run's first update is step 5 after a save at step 4, not
    step 1 again beside the first run's."""
    from llmrl.engine.client.tracking import Tracker
    from llmrl.engine.config.types import TrackingConfig

    settings = TrackingConfig(backends=("csv",), dir=str(tmp_path / "runs"), run_name="r")
    first = Tracker(settings, ["main"])
    for _ in range(4):
        first.log_update("main", [{"loss": 1.0}], 2, 0.1)
    saving.save_run(FakeRun(tiny), lambda future: future.result(), str(tmp_path / "ckpt"), None, first.position())
    first.close()
    resumed = load_config(raw={"llms": {"main": {"model": tiny["llama"], "checkpoint": str(tmp_path / "ckpt")}}},
                          check_plugins=False)
    assert saving.resumed_tracking(resumed) == {"step": 4, "updates": 4}
    fresh = load_config(raw={"llms": {"main": {"model": tiny["llama"]}}}, check_plugins=False)
    assert saving.resumed_tracking(fresh) is None
    again = Tracker(settings, ["main"])
    again.resume(saving.resumed_tracking(resumed))
    assert again.log_update("main", [{"loss": 0.5}], 2, 0.1) and again.step == 5
    again.close()


def test_the_scripts_client_state_is_saved_in_the_checkpoint_and_read_back_by_the_resumed_run(tiny, tmp_path):
    """``save(path, client_state=...)`` keeps the script's plain data (tensors included) beside the LLMs' state; a
    run resuming from the checkpoint reads it back equal, a fresh run reads None. State that is not plain data is
    refused before anything is written, naming where it sits, and the checkpoint already there is untouched."""
    import torch

    state = {"step": 3, "rollouts": {"next_call": 5, "buffer": [[4, 2, {"tokens": torch.tensor([7, 8]),
                                                                        "text": "ab", "reward": -0.5}]]}}
    run = FakeRun(tiny)
    saving.save_run(run, lambda future: future.result(), str(tmp_path / "ckpt"), client_state=state)
    resumed = load_config(raw={"llms": {"main": {"model": tiny["llama"], "checkpoint": str(tmp_path / "ckpt")}}},
                          check_plugins=False)
    back = saving.resumed_client_state(resumed)
    assert back["step"] == 3 and back["rollouts"]["next_call"] == 5
    (index, version, sample), = back["rollouts"]["buffer"]
    assert (index, version, sample["text"], sample["reward"]) == (4, 2, "ab", -0.5)
    assert torch.equal(sample["tokens"], torch.tensor([7, 8]))
    assert saving.resumed_client_state(load_config(raw={"llms": {"main": {"model": tiny["llama"]}}},
                                                   check_plugins=False)) is None
    with pytest.raises(InvalidArgument, match=r"client_state\['cursor'\] is a set"):
        saving.save_run(run, lambda future: future.result(), str(tmp_path / "ckpt"), client_state={"cursor": {1}})
    assert run.saves == 1 and weights(tmp_path / "ckpt") == "save 1"  # nothing was sent, nothing replaced
    assert saving.resumed_client_state(resumed)["step"] == 3
