"""Three ``tinker-cookbook`` recipes run unmodified against ``llmrl tinker`` (the tiny model; a few steps each): RL on
arithmetic (single turn), guess-the-number (multi-turn), and chat SFT on the cookbook's own example conversations.
Each must finish, write one ``metrics.jsonl`` row per step with the recipe's own metrics (reward, or NLL), and show
that the training steps happened on the service (the KL between the sampler's and the learner's log-probs is
reported, and it is near 0 on the first step: both read the same weights). The service is given its key by
``--api-key``, which only the command's own line shows. It serves under ZeRO-3 with 2 replicas: the base model
partitioned over both ranks, each training client an adapter created at run time, whole on both (the service at
ZeRO 0 is ``test_tinker_service_live``'s).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from testkit.scripts import run_module
from testkit.tinker import command_lines_holding, start_tinker, stop_tinker

pytestmark = pytest.mark.slow
KEY = "tml-llmrl-recipes"


@pytest.fixture(scope="module")
def service(tiny):
    lora = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}
    config = {"llms": {"main": {"model": tiny["llama"], "initializers": [lora], "trainable": True, "replicas": 2,
                                # guess-the-number's prompts grow past the tiny model's 512 positions
                                "model_kwargs": {"max_position_embeddings": 4096},
                                "training": {"zero_stage": 3, "optimizer": {"type": "adamw", "lr": 1e-4}}}},
              "threads_per_rank": 1}
    running = start_tinker(config, Path(tempfile.mkdtemp(prefix="tinker-recipes-")), KEY, key_by="flag")
    yield {**running, "model": tiny["llama"]}
    stop_tinker(running)


def test_a_key_given_by_api_key_shows_in_the_command_only(service):
    """``--api-key K`` (documented as visible to other local users) still works, and ``llmrl tinker`` hands K to
    the launcher and the ranks in their environment: no line but the command's own shows it."""
    assert len(command_lines_holding(service, "llmrl")) >= 3
    assert list(command_lines_holding(service, KEY)) == [service["process"].pid]


def run_recipe(service, tmp_path, module: str, *args: str) -> list[dict]:
    """``python -m module args`` against the service (forked by the session's server: the recipe, unmodified, is
    the subject, not how an interpreter starts); its metrics rows."""
    env = {"TINKER_BASE_URL": service["url"], "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}
    log = tmp_path / "run"
    result = run_module(module, [f"model_name={service['model']}", "renderer_name=role_colon", f"log_path={log}",
                                 "behavior_if_log_dir_exists=raise", *args], env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_arithmetic_rl_recipe(service, tmp_path):
    rows = run_recipe(service, tmp_path, "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", "group_size=4",
                      "groups_per_batch=4", "max_steps=2", "max_tokens=8", "learning_rate=1e-4", "save_every=0",
                      "loss_fn=importance_sampling", "lora_rank=4")
    steps = [row for row in rows if "env/all/reward/total" in row]
    assert len(steps) == 2
    assert abs(steps[0]["optim/kl_sample_train_v1"]) < 1e-4  # the sampler read the weights the learner trains


def test_guess_the_number_multi_turn_recipe(service, tmp_path):
    rows = run_recipe(service, tmp_path, "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", "group_size=2",
                      "batch_size=2", "max_tokens=6", "max_steps=2", "eval_every=0", "save_every=0")
    steps = [row for row in rows if "env/all/reward/total" in row]
    assert len(steps) == 2 and all(row["env/all/turns_per_episode"] >= 1 for row in steps)


def test_chat_sft_recipe(service, tmp_path):
    import tinker_cookbook

    data = os.path.join(os.path.dirname(tinker_cookbook.__file__), "example_data", "conversations.jsonl")
    rows = run_recipe(service, tmp_path, "tinker_cookbook.recipes.chat_sl.train", f"dataset={data}", "batch_size=8",
                      "max_steps=3", "save_every=0", "eval_every=0", "lora_rank=4")
    assert len(rows) == 3 and all(row["train_mean_nll"] > 0 for row in rows)
