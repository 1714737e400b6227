"""Launching: `llmrl run` and the raw `deepspeed --module llmrl.launch` form, a two-node run simulated on
one machine, and fast, clean failures for a wrong rank count or a broken config."""

from __future__ import annotations

import base64
import glob
import json
import os
import secrets
import subprocess
import sys

import psutil
import pytest
import torch
import yaml

from llmrl.engine.transport.rendezvous import free_port
from testkit import reference_scores

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "score_and_report.py")
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def write_config(tmp_path, config) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def run(cmd, timeout=300, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def llmrl(*args):
    return [sys.executable, "-m", "llmrl.launch.cli", *args]


def leftovers(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
                found.append(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def check_report(out, reference_models, replicas):
    with open(out) as f:
        report = json.load(f)
    model, tok = reference_models["llama"]
    (expected,) = reference_scores(model, tok, ["You see a wall"], [[" turn left", " go forward"]])
    torch.testing.assert_close(torch.tensor(report["scores"][0]), expected, atol=1e-4, rtol=0)
    assert sorted(s["replica"] for s in report["servers"].values() if s["llm"] == "main") == list(range(replicas))
    assert len(glob.glob(f"{out}.ran.*")) == 1, "the script must run on rank 0 only"
    return report


@pytest.mark.budget(120, why="a whole `llmrl run` from an empty model cache (the builtin model built first), two LLMs "
                              "on four ranks: 62 s on a 2-core AVX2-only EPYC with the other worker busy")
def test_llmrl_run(tmp_path, tiny):
    """As a user runs it on a fresh machine: a builtin model in an empty model cache, which `llmrl run` builds
    before the launcher starts. Also: the script closes a second LLM first (Caller.close_llm); its rank's early,
    clean exit is not a failure of the run, and a call to it says it was closed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path, {"llms": {"main": {"model": "builtin:tiny-random-llama", "replicas": 2},
                                              "spare": {"model": tiny["gpt2"]}}, "threads_per_rank": 1})
    out = str(tmp_path / "report.json")
    cache = tmp_path / "cache"
    result = run(llmrl("run", "--config", config, SCRIPT, out, "--flag"),
                 env={**os.environ, "LLMRL_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr
    # DeepSpeed's per-node launcher, started directly (the runner would only have started it), for 4 ranks
    (started,) = [line for line in result.stderr.splitlines() if line.startswith("llmrl: running ")]
    world_info = next(token for token in started.split() if token.startswith("--world_info="))
    assert "-m deepspeed.launcher.launch " in started and "deepspeed --" not in started, started
    assert json.loads(base64.urlsafe_b64decode(world_info.split("=", 1)[1])) == {"localhost": [0, 1, 2, 3]}
    assert os.listdir(cache / "models") == ["tiny-random-llama"]
    built = result.stderr.find("llmrl: building builtin:tiny-random-llama")
    assert 0 <= built < result.stderr.find("llmrl: running"), result.stderr[-3000:]  # before the launcher started
    folder = cache / "models" / "tiny-random-llama"
    plain = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    report = check_report(out, {"llama": plain}, replicas=2)
    assert report["argv"] == [SCRIPT, out, "--flag"]  # no --local_rank, no launcher arguments
    assert report["closed"]["spare"].startswith("LLMClosedError: LLM 'spare' was closed with close_llm()")
    assert [s["closed"] for s in report["servers"].values()] == [False, False, True]
    assert "without a clean stop" not in result.stderr
    # quiet: no warning that is not about the user's run (DeepSpeed's "Unable to find hostfile", bitsandbytes' CPU
    # kernel note, Python warnings from the libraries)
    assert [line for line in result.stderr.splitlines() if "warn" in line.lower()] == []
    assert leftovers(config) == []


def test_a_script_that_ends_before_its_servers_connect_ends_the_run_at_once_and_quietly(tmp_path, tiny):
    """A script's --help ends it before any Caller: its servers, still starting, were never told to stop. They
    are ended without the "frozen, or stuck" line (which came after a 10 s wait) and leave nothing behind."""
    config = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"]}}})
    script = tmp_path / "with_flags.py"
    script.write_text("import argparse\nargparse.ArgumentParser(description='flags only').parse_args()\n")
    result = run(llmrl("run", "--config", config, str(script), "--help"))
    assert result.returncode == 0, result.stderr
    assert "flags only" in result.stdout
    assert "stuck" not in result.stderr and "without a clean stop" not in result.stderr, result.stderr
    assert leftovers(config) == []


def test_raw_deepspeed_launch_and_exit_code(tmp_path, tiny, reference_models):
    config = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"]}}})
    out = str(tmp_path / "report.json")
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "llmrl.launch",
           "--config", config, SCRIPT, out, "--exit", "3"]
    result = run(cmd)
    assert result.returncode == 3, result.stderr[-3000:]
    check_report(out, reference_models, replicas=1)
    assert leftovers(config) == []


def test_two_nodes_on_one_machine(tmp_path, tiny, reference_models):
    config = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"], "replicas": 3}}, "threads_per_rank": 1})
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    out = str(tmp_path / "report.json")
    port = str(free_port())
    env = {**os.environ, "LLMRL_RUN_SECRET": secrets.token_hex(32)}  # the nodes share the run's secret
    node0 = subprocess.Popen(llmrl("run", "--config", config, "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
                                   "0", "--master_addr", "127.0.0.1", "--master_port", port, SCRIPT, out),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    node1 = subprocess.Popen([DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1", "--master_addr",
                              "127.0.0.1", "--master_port", port, "--module", "llmrl.launch", "--config", config,
                              SCRIPT, out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log0, _ = node0.communicate(timeout=300)
    log1, _ = node1.communicate(timeout=300)
    assert node0.returncode == 0, log0[-3000:]
    assert node1.returncode == 0, log1[-3000:]
    check_report(out, reference_models, replicas=3)
    assert leftovers(config) == []


def test_wrong_rank_count_fails_fast_with_one_message(tmp_path, tiny):
    config = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"], "replicas": 2}}})
    result = run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "llmrl.launch",
                  "--config", config, SCRIPT, str(tmp_path / "never.json")])
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("the launcher started 2 rank(s) but the config needs 3") == 1
    assert not os.path.exists(tmp_path / "never.json") and leftovers(config) == []


def test_broken_config_fails_before_anything_starts(tmp_path, tiny):
    config = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"], "replica": 2, "dtype": "fp32"}}})
    result = run(llmrl("run", "--config", config, SCRIPT, str(tmp_path / "never.json")))
    assert result.returncode == 2
    assert "llms.main.replica: unknown key 'replica' (did you mean 'replicas'?)" in result.stderr
    assert "llms.main.dtype" in result.stderr and "llmrl: running" not in result.stderr
    raw = run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "llmrl.launch",
               "--config", config, SCRIPT, str(tmp_path / "never.json")])
    assert raw.returncode == 2
    assert (raw.stdout + raw.stderr).count("did you mean 'replicas'?") == 1
    assert leftovers(config) == []


def test_validate_command(tmp_path, tiny):
    """`llmrl validate` as a command (forked by the session's server: its subject is what it prints, not how an
    interpreter starts)."""
    from testkit.scripts import run_module

    good = write_config(tmp_path, {"llms": {"main": {"model": tiny["llama"], "replicas": 2}}})
    result = run_module("llmrl.launch.cli", ["validate", good, "llms.main.tensor_parallel=2"])
    assert result.returncode == 0 and "needs 5 ranks" in result.stdout
    result = run_module("llmrl.launch.cli", ["validate", good, "llms.main.tensor_parallel=3"])
    assert result.returncode == 2 and "llms.main.tensor_parallel: 3 does not divide" in result.stderr


def test_caller_outside_a_launch_explains_how_to_start():
    code = "from llmrl import Caller\ntry:\n    Caller()\nexcept RuntimeError as e:\n    print(e)"
    result = run([sys.executable, "-c", code])
    assert "llmrl run --config CONFIG script.py" in result.stdout
