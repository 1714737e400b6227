"""Every demo end to end with a tiny random model (``--quick``), its script under the tests' launcher
(:mod:`testkit.scripts`), whose ranks start without importing torch and DeepSpeed again. What ``llmrl run`` adds
(building a builtin model in an empty cache before the launcher starts, a launch without warnings) is tested through
``llmrl run`` itself in ``test_launch_live.py::test_llmrl_run``. Every demo's tracked scalars (the shipped configs'
csv and TensorBoard back ends) agree with its own metrics.csv."""

import csv
import importlib.util
import json
import math
import os
import shutil

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quiet(stderr: str) -> None:
    """No warning that is not about the user's run: none from DeepSpeed's launcher, torch, bitsandbytes..."""
    assert [line for line in stderr.splitlines() if "warn" in line.lower()] == [], stderr[-3000:]


def demo(cwd, config: str, script: str, *args: str, overrides=(), env: dict | None = None):
    """Run ``examples/<script> args`` in ``cwd`` under ``configs/<config>`` (``threads_per_rank=1`` and
    ``overrides``) with the tests' launcher (:func:`testkit.scripts.run_script`: ranks forked from the session's
    preloaded server)."""
    from testkit.scripts import run_script

    return run_script(os.path.join(ROOT, "configs", config), os.path.join(ROOT, "examples", script), args,
                      overrides=["threads_per_rank=1", *overrides], env=env, cwd=cwd)


def tracked(out, script: str) -> dict[tuple[int, str], float]:
    """The scalars a demo's run tracked under ``--out`` (``<script>-<date>-<time>/scalars.csv``), by (step, key);
    the TensorBoard events are beside them."""
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(script + "-")]
    assert list(run_dir.glob("events.out.tfevents.*")), sorted(os.listdir(run_dir))
    with open(run_dir / "scalars.csv") as f:
        return {(int(r["step"]), r["key"]): float(r["value"]) for r in csv.DictReader(f)}


@pytest.mark.parametrize("replicas", [1])  # the README's layout; 2 replicas: the other demos (and the suite's time)
def test_ppo_demo_quick(tmp_path, replicas):
    out = tmp_path / "out"
    result = demo(tmp_path, "ppo-babyai-quick.yaml", "ppo_babyai.py", "--quick", "--out", str(out),
                  overrides=[f"llms.policy.replicas={replicas}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["episodes"] == 8 and summary["after"]["episodes"] == 8
    for evaluation in (summary["before"], summary["after"]):
        low, high = evaluation["ci95"]
        assert low <= evaluation["success_rate"] <= high
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2  # --quick: two PPO updates
    assert all(float(row["samples"]) == 16 for row in rows), rows  # 4 environments x 4 steps per update
    scalars = tracked(out, "ppo_babyai")
    for step, row in enumerate(rows, 1):  # update's statistics, written on their own, and the script's scalars
        assert scalars[(step, "update/policy_loss")] == pytest.approx(float(row["policy_loss"]))  # equal shares
        assert scalars[(step, "train/success_rate")] == float(row["success_rate"])
    assert scalars[(2, "update/replicas")] == replicas and (2, "server/policy/kv_cache_hit_rate") in scalars
    assert scalars[(0, "eval/success_rate")] == summary["before"]["success_rate"]
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reuse = summary["reuse"]  # the config's kv_cache_mb and trunk_reuse_mb at work on every replica
    assert len(reuse) == replicas, reuse
    for rank in reuse.values():
        assert rank["trunk_replayed_calls"] > 0 and rank["kv_cache_hit_rate"] > 0, reuse


@pytest.mark.parametrize("updater,replicas", [("ppo_tokens", 1), ("grpo", 2)])
def test_rlhf_demo_quick(tmp_path, updater, replicas):
    """The RLHF demo (generate, VADER reward, update) with each updater, chosen by the config alone."""
    out = tmp_path / "out"
    result = demo(tmp_path, "rlhf-sentiment-quick.yaml", "rlhf_sentiment.py", "--quick", "--out", str(out),
                  overrides=[f"llms.policy.replicas={replicas}", f"llms.policy.updater.plugin={updater}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    for evaluation in (summary["before"], summary["after"]):
        low, high = evaluation["ci95"]
        assert evaluation["prompts"] == 8 and low <= evaluation["mean_reward"] <= high
        assert len(evaluation["continuations"]) == 8
    assert len(summary["pairs"]) == 8
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(int(row["samples"]) == 8 for row in rows), rows  # 4 prompts x 2 continuations
    assert ("kl_coef" in rows[0]) == (updater == "ppo_tokens")
    scalars = tracked(out, "rlhf_sentiment")
    assert [scalars[(k, "train/reward")] for k in (1, 2)] == [float(row["reward"]) for row in rows]
    assert scalars[(2, "update/samples")] == 4  # prompts, split over the replicas
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("script,replicas,flags", [("rlhf_grpo_in_script.py", 2, ()), ("dpo_in_script.py", 1, ()),
                                                   ("reasoning_gym_grpo.py", 1, ()),
                                                   ("rlhf_grpo_in_script.py", 1,
                                                    ("--async-staleness", "1", "--sampler", "sampler"))])
def test_loss_in_script_demos_quick(tmp_path, script, replicas, flags):
    """The demos whose loss lives in the script (forward_backward / forward_backward_custom, optim_step,
    a snapshot as the reference) end to end with a tiny model; the GRPO one also sampling on a background thread
    within one step of the trained weights, on a sampler LLM of its own whose weights it syncs every step."""
    if script == "reasoning_gym_grpo.py" and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("needs reasoning-gym (the envs extra, which setup.sh installs)")
    out = tmp_path / "out"
    config = "rlhf-sentiment-script-sampler-quick.yaml" if "--sampler" in flags else "rlhf-sentiment-script-quick.yaml"
    result = demo(tmp_path, config, script, "--quick", *flags, "--out", str(out),
                  overrides=[f"llms.policy.replicas={replicas}"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["history"]) == 2
    for evaluation in (summary["before"], summary["after"]):
        low, high = evaluation["ci95"]
        value = evaluation.get("mean_reward", evaluation.get("rate"))
        assert low <= value <= high
    if flags:  # the first batch is sampled before any step (on-policy: ratio 1); none is over 1 step behind
        first, second = summary["history"]
        assert first["staleness_max"] == 0.0 and second["staleness_max"] in (0.0, 1.0)
        assert first["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    scalars = tracked(out, script.removesuffix(".py"))
    key = "update/policy/optimizer_steps" if "--sampler" in flags else "update/optimizer_steps"  # several LLMs
    assert [scalars[(k, key)] for k in (1, 2)] == [1, 1]  # each optim_step, tracked
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TEXTWORLD_GAMES = sorted(f"coin-L1-s{seed}.{ext}" for seed in (0, 1, 10000, 10001) for ext in ("json", "ni", "z8"))
GENERATED: dict[str, str] = {}  # "textworld": the games folder the first demo run generated


@pytest.mark.parametrize("mode,replicas", [("choose", 1), ("write", 2)])
def test_textworld_demo_quick(tmp_path, mode, replicas):
    """The multi-turn demo end to end with a tiny model, in both action modes: TextWorld games generated offline
    into an empty cache (by the first of the two runs; the second finds them in its cache, as a user's second run
    does), episodes played as chats, grpo_turns updates, greedy evaluations on held-out games."""
    pytest.importorskip("textworld", reason="the textworld extra (setup.sh installs it)")
    out = tmp_path / "out"
    if "textworld" in GENERATED:
        shutil.copytree(GENERATED["textworld"], tmp_path / "textworld")
    result = demo(tmp_path, "textworld-quick.yaml", "textworld_agent.py", "--quick", "--mode", mode, "--out", str(out),
                  overrides=[f"llms.policy.replicas={replicas}"], env={"LLMRL_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    assert sorted(os.listdir(tmp_path / "textworld")) == TEXTWORLD_GAMES
    GENERATED.setdefault("textworld", str(tmp_path / "textworld"))
    summary = json.loads((out / "summary.json").read_text())
    assert [e["update"] for e in summary["evaluations"]] == [0, 1, 2]
    for evaluation in summary["evaluations"]:
        low, high = evaluation["ci95"]
        assert evaluation["episodes"] == 2 and low <= evaluation["success_rate"] <= high
        turns = len(evaluation["actions"])  # a model turn after each generation prompt (one more when cut short)
        assert turns >= 1 and evaluation["transcript"].count("<s>assistant\n") in (turns, turns + 1)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["episodes"]) for r in rows] == [4, 8]  # 1 game x 4 episodes per update
    if mode == "choose":  # a random choice among 4 commands wins some episodes of a group: grpo_turns steps
        assert any(int(r["skipped"]) == 0 for r in rows), rows
        assert all(math.isfinite(float(r["policy_loss"])) for r in rows), rows
    scalars = tracked(out, "textworld_agent")
    assert [scalars[(k, "train/success_rate")] for k in (1, 2)] == [float(r["success_rate"]) for r in rows]
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offline_dpo_demo_quick(tmp_path):
    """The offline DPO demo end to end with a tiny model: pairs sampled and ranked, the dpo updater, both
    evaluations, the files and the tracked scalars."""
    out = tmp_path / "out"
    result = demo(tmp_path, "dpo-sentiment-quick.yaml", "dpo_sentiment.py", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pairs"]["prompts"] == 8 and 1 <= summary["pairs"]["pairs"] <= 8
    assert summary["pairs"]["mean_chosen_reward"] >= summary["pairs"]["mean_rejected_reward"]
    for evaluation in (summary["before"], summary["after"]):
        low, high = evaluation["ci95"]
        assert evaluation["prompts"] == 8 and low <= evaluation["mean_reward"] <= high
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(summary["history"]) >= 1
    scalars = tracked(out, "dpo_sentiment")
    assert scalars[(1, "train/loss")] == pytest.approx(float(rows[0]["loss"]))
    assert scalars[(1, "update/samples")] >= 1
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nlpo_demo_quick(tmp_path):
    """The RLHF demo with nlpo and steered sampling: every sampled token lies in the masking policy's set (no
    miss), the masking policy is snapshotted after each update (mask_sync_every 1)."""
    out = tmp_path / "out"
    result = demo(tmp_path, "rlhf-sentiment-nlpo-quick.yaml", "rlhf_sentiment.py", "--quick", "--steer", "--out",
                  str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(float(row["mask_misses"]) == 0.0 for row in rows), rows
    assert all(0 < float(row["mask_size"]) < 320 for row in rows), rows  # the tiny model's vocabulary: 320
    summary = json.loads((out / "summary.json").read_text())
    assert all(e["prompts"] == 8 for e in (summary["before"], summary["after"]))
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offline_ilql_demo_quick(tmp_path):
    """The offline ILQL demo end to end with a tiny model: a sampled dataset, the ilql updater, the evaluations
    (base, language model alone, steered), the files and the tracked scalars."""
    out = tmp_path / "out"
    result = demo(tmp_path, "ilql-sentiment-quick.yaml", "ilql_sentiment.py", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    quiet(result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"]["continuations"] == 16  # 8 prompts x 2
    assert [e["label"] for e in summary["after"]] == ["after, language model alone", "after, steered, beta 1"]
    for evaluation in (summary["before"], *summary["after"]):
        low, high = evaluation["ci95"]
        assert evaluation["prompts"] == 8 and low <= evaluation["mean_reward"] <= high
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(summary["history"]) == 2  # 8 prompts, 4 per update, one epoch
    scalars = tracked(out, "ilql_sentiment")
    assert scalars[(1, "train/loss_q")] == pytest.approx(float(rows[0]["loss_q"]))
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpo_with_your_own_prompts_and_reward_quick(tmp_path, tiny):
    """The GPU how-to's script (docs/how-to/grpo-on-gpus.md) on its own config, made a CPU run by overrides: prompts
    from a JSONL file, a reward function from the user's module, called TRL's way (every other JSONL field passed as a
    list aligned with the completions); every reward it reports is that function's value on the completion it shows."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {n}:", "target": n}) + "\n"
                                                    for n in range(12)))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, completions, target, **fields):\n"
        "    assert len(prompts) == len(completions) == len(target)\n"
        "    return [float(len(c) % 5 + t % 3) for c, t in zip(completions, target)]\n")
    out = tmp_path / "out"
    result = demo(tmp_path, "gpu-grpo.yaml", "grpo_custom_reward.py", "--quick", "--no-chat", "--prompts",
                  str(tmp_path / "prompts.jsonl"), "--reward", "my_reward:score", "--out", str(out),
                  overrides=[f"llms.policy.model={tiny['llama']}", "llms.policy.dtype=float32",
                             "llms.policy.devices=cpu", "llms.policy.replicas=1"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    targets = list(range(12))[-4:]  # --quick holds out the last 4 prompts
    for evaluation in (summary["before"], summary["after"]):
        assert evaluation["rewards"] == [float(len(c) % 5 + t % 3) for c, t in zip(evaluation["completions"],
                                                                                   targets)]
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(float(row["completions"]) == 4 for row in rows)  # 2 prompts x 2 completions
    assert (out / "curve.png").stat().st_size > 0
    assert {"date", "commit", "hardware", "versions"} <= set(summary["provenance"])
