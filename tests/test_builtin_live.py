"""Builtin models in real runs (issue 17): a 2-replica and a tensor-parallel-2 run of ``builtin:tiny-random-llama``
started through the plain ``deepspeed --module llmrl.launch`` path on an empty cache score like plain Hugging
Face on the folder they made; the tokenizer-only folder the old bug left is repaired by the next run; a
folder llmrl did not make stops the run at once with a clear message. And the root cause: on rank 1 of a
process group transformers skips the model in save_pretrained, yet the builtin conversion there is complete.

References: plain transformers on the cache folder (``reference_scores``), the tiny model built in the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmrl.engine.model.store.folders import MARKER
from llmrl.engine.transport.rendezvous import free_port
from testkit import LiveRun, reference_scores

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "tiny-random-llama"
CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball"]
CANDIDATES = [[" turn left", " go forward"], [" pick up", " drop", " toggle"]]
LAYOUTS = {"2 replicas": {"replicas": 2}, "tensor-parallel 2": {"tensor_parallel": 2}}


def config(layout):
    return {"llms": {"main": {"model": f"builtin:{NAME}", **LAYOUTS[layout]}}, "threads_per_rank": 1}


def plain_hf_scores(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return reference_scores(model, AutoTokenizer.from_pretrained(folder), CONTEXTS, CANDIDATES)


def run_and_score(tmp_path, layout):
    cache = tmp_path / "cache"
    run = LiveRun(config(layout), env={"LLMRL_CACHE": str(cache)}, workdir=str(tmp_path))
    with run:
        scores = run.score(CONTEXTS, CANDIDATES)
    assert run.process.returncode == 0, run.log
    assert run.leftover_processes() == []
    return scores, cache / "models", run.log


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_fresh_cache_works_with_two_replicas_and_tensor_parallel(tmp_path, layout):
    scores, models, log = run_and_score(tmp_path, layout)
    assert os.listdir(models) == [NAME], log  # one entry, no staging or moved-aside folder
    assert (models / NAME / MARKER).is_file()
    for got, want in zip(scores, plain_hf_scores(models / NAME)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert "unusable" not in log


def test_the_tokenizer_only_folder_left_by_the_old_bug_is_repaired_by_the_next_run(tmp_path):
    from test_builtin_cache import BUG_FILES, plant_bug_folder

    planted = plant_bug_folder(tmp_path / "cache" / "models")
    scores, models, log = run_and_score(tmp_path, "2 replicas")
    asides = [p for p in models.iterdir() if p.name.startswith(f"{NAME}.broken-")]
    assert sorted(p.name for p in models.iterdir()) == sorted([NAME, asides[0].name])
    assert {f: (asides[0] / f).read_bytes() for f in BUG_FILES} == planted  # moved aside, not deleted
    assert len([line for line in log.splitlines() if "unusable" in line]) == 1, log
    for got, want in zip(scores, plain_hf_scores(models / NAME)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_foreign_folder_at_the_entry_stops_the_run_with_a_clear_message(tmp_path):
    folder = tmp_path / "cache" / "models" / NAME
    folder.mkdir(parents=True)
    (folder / "data.bin").write_bytes(b"mine")
    with pytest.raises(RuntimeError) as failed:
        LiveRun(config("2 replicas"), env={"LLMRL_CACHE": str(tmp_path / "cache")}, workdir=str(tmp_path))
    assert "not made by llmrl" in str(failed.value) and "LLMRL_CACHE" in str(failed.value)
    assert os.listdir(folder) == ["data.bin"]
    assert leftovers(str(tmp_path / "config.yaml")) == []


def leftovers(marker: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
                found.append(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_on_rank_1_of_a_process_group_the_builtin_conversion_still_writes_the_model(tmp_path):
    """transformers 5 writes no model from save_pretrained on a non-zero rank (the cause of issue 17); the
    other savers the checkpoint export uses do write; the builtin conversion is complete there."""
    from test_builtin_cache import assert_is_the_tiny_llama

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LLMRL_CACHE": str(tmp_path / "cache")}
    script = os.path.join(HERE, "scripts", "hf_save_on_rank.py")
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path)], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["torch_distributed_initialized"]
    # The trap is real here (else this test would prove nothing): no weights, no config from the model save.
    assert "model.safetensors" not in report["plain_model_save"] and "config.json" not in report["plain_model_save"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(report["export"]["tokenizer"])
    assert {"config.json", "generation_config.json"} <= set(report["export"]["model"])
    assert "adapter_config.json" in report["export"]["adapter"]
    assert report["builtin"] == str(tmp_path / "cache" / "models" / NAME)
    assert_is_the_tiny_llama(report["builtin"])
