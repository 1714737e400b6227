"""The benchmarks run end to end on tiny inputs: benchmarks.run writes its table, benchmarks.memory prints both of its
rows with identical results on CPU (no timing or memory figure is asserted here)."""

import json
import os
import re
import subprocess

import pytest

from testkit.scripts import run_module

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<module> args...`` from the repository root (forked by the session's server: the
    benchmark's own live runs are forked by it too); asserts it exited 0."""
    result = run_module(f"benchmarks.{module}", args, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_benchmark_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    result = run_benchmark("run", "--model", "tiny", "--quick", "--out", str(out))
    rows = {row["workload"]: row for row in json.loads(out.read_text())["rows"]}
    assert {"6 candidates", "64 candidates", "minimal request round trip", "memory per server (MB)"} <= set(rows)
    for name in ("6 candidates", "64 candidates"):
        assert rows[name]["max |llmrl - naive|"] < 1e-3 and rows[name]["max |llmrl - in-process|"] < 1e-3
        assert rows[name]["max |per-token sums - llmrl|"] < 1e-3 and rows[name]["per-token / summed"] > 0
    assert "speedup vs naive" in result.stdout and "compute limit" in result.stderr
    episodes = next(row for name, row in rows.items() if name.startswith("episodes"))
    assert episodes["max |cache on - cache off|"] < 1e-4 and episodes["max |cache on - naive|"] < 1e-3
    assert episodes["cache hit rate"] > 0.5  # each step's context extends the previous one
    synthetic = next(row for name, row in rows.items() if name.startswith("update (synthetic"))
    assert synthetic["max |stats every-layer - trunk-reuse| (first update, equal weights)"] < 1e-4
    babyai = next(row for name, row in rows.items() if name.startswith("update (babyai"))
    assert babyai["distinct prompts"] < babyai["transitions"]  # the demo's states repeat: twins to compute once
    assert babyai["max |stats every-layer-every-twin - trunk-and-twins-once| (first update, equal weights)"] < 1e-4
    for update in (synthetic, babyai):
        assert update["replayed calls"] > 0 and update["whole calls"] == 0


def test_memory_benchmark_runs_every_row_on_small_inputs():
    result = run_benchmark("memory", "--prompts", "2", "--rows", "4", "--prompt-tokens", "8", "--new-tokens", "6",
                           "--one-prompt-rows", "6", "--max-rows", "4", "--forked-children")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("generate: 4 rows x 6 tokens") and "plain HF with output_logits" in lines[1]
    assert lines[4].startswith("score per_token + entropy: 4 rows x 6 tokens")
    assert lines[8].startswith("generate, one prompt's samples: 6 rows x 6 tokens")
    assert "runs within 4 rows" in lines[10]
    # on CPU the two paths sample the same tokens and give the same log-probs (and the same scores)
    assert lines[3].endswith("same tokens, largest difference 0.00e+00")
    assert lines[7].endswith("same tokens, largest difference 0.00e+00")
    assert "same tokens" in lines[11] and float(lines[11].rsplit(" ", 1)[1]) < 1e-5


def test_update_memory_benchmark_runs_every_path_with_the_same_trained_weights():
    result = run_benchmark("update_memory", "--prompts", "1", "--samples", "2", "--prompt-tokens", "8",
                           "--new-tokens", "8", "--updaters", "grpo")
    lines = result.stdout.splitlines()
    lines = lines[next(k for k, line in enumerate(lines) if line.startswith("grpo update")):]  # after DeepSpeed's note
    assert lines[0].startswith("grpo update: 1 prompts x 2 continuations x 8 new tokens (32 tokens)")
    assert [line.split(":")[0].strip() for line in lines[1:5]] == [
        "llmrl before (one pass per micro-batch, whole logits)", "llmrl defaults (token-bounded passes, chunked "
        "log-probs)", "llmrl defaults + gradient_checkpointing", "plain HF + PEFT, checkpointing, 8 sequences per pass"]
    for line in lines[1:4]:  # every llmrl path trains the same weights
        assert float(line.rsplit("by ", 1)[1]) < 1e-6, line


def test_decoding_benchmark_runs_every_path_on_a_tiny_model(tmp_path):
    out = tmp_path / "decoding.json"
    run_benchmark("run", "decoding", "--device", "cpu", "--shape", "tiny", "--batch1-shape", "tiny", "--new-tokens",
                  "8", "--prompts", "2", "--samples", "2", "--out", str(out))
    rows = json.loads(out.read_text())
    assert rows["exactness"]["greedy sequences equal to HF (adapter unmerged)"] == "2/2"
    assert rows["exactness"]["largest |loop log-prob - plain forward log-prob|"] < 1e-5
    row = rows["4 x 8 tokens"]
    assert "error" not in row and row["llmrl decoder stats"]["calls"] == {"llmrl": 3}
    assert "error" not in rows["4 x 8 tokens, HF static cache + compile, no adapter"]
    assert "error" not in rows["batch 1, tiny float32, 128 greedy tokens"]


def test_packing_choice_benchmark_unpacks_long_continuations_with_the_same_results():
    result = run_benchmark("packing_choice", "--shape", "narrow", "--samples", "4", "--new-tokens", "48",
                           "--prompt-tokens", "8", "--repeats", "1")
    lines = result.stdout.splitlines()
    assert lines[1].strip().startswith("planned (unpacked,") and "packed always" in lines[2]
    found = re.search(r"log-probs (\S+), LoRA gradients (\S+) ", lines[3])
    assert found and float(found[1]) < 1e-5 and float(found[2]) < 1e-4, lines[3]


def test_attention_window_benchmark_windows_the_cache_with_the_same_tokens():
    result = run_benchmark("run", "attention-window", "--shape", "tiny", "--new-tokens", "40", "--length-bucket", "16")
    assert "whole cache / windowed:" in result.stdout and "same greedy tokens" in result.stdout, result.stdout
    found = re.search(r"log-probs within (\S+)", result.stdout)
    assert found and float(found[1]) < 1e-5, result.stdout


def test_zero3_call_overhead_benchmark_times_both_ways_of_entering_a_gathered_call():
    result = run_benchmark("zero3_call_overhead", "--layouts", "top-8", "--calls", "1", "--repeats", "1")
    assert re.search(r"top-8: \d+ modules, \d+ weights, \d+ hooks", result.stdout), result.stdout
    assert re.search(r"deepspeed-unwrap +\d", result.stdout) and re.search(r"llmrl +\d.*x \(", result.stdout)


@pytest.mark.skipif(not __import__("torch").backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_onednn_rows_benchmark_meets_fewer_row_counts_padded():
    result = run_benchmark("onednn_rows", "--products", "60", "--max-rows", "200", "--in", "8", "--out", "8")
    counts = dict(re.findall(r"(as-given|padded) +(\d+) row counts met", result.stdout))
    assert int(counts["padded"]) < int(counts["as-given"]), result.stdout
    assert "padded / as given: memory growth" in result.stdout, result.stdout


def test_cache_memory_benchmark_reports_both_servers_and_the_cache_within_its_cap():
    result = run_benchmark("cache_memory", "--calls", "20")
    found = re.search(r"after +20 calls: cached +([\d.]+), twin +([\d.]+), .*the cache's tensors ([\d.]+) MB "
                      r"of its 1 MB", result.stdout)
    assert found and float(found[1]) > 0 and float(found[2]) > 0 and 0 < float(found[3]) <= 1, result.stdout


def test_multi_lora_benchmark_decodes_every_adapters_prompts_in_one_call_with_the_same_tokens():
    result = run_benchmark("multi_lora", "--shape", "tiny", "--adapters", "3", "--prompts", "2", "--new-tokens", "6",
                           "--repeats", "1")
    found = re.search(r"one call is ([\d.]+)x the adapter-a-call rate; greedy tokens the same: True; largest "
                      r"log-prob difference (\S+)", result.stdout)
    assert found and float(found[1]) > 0 and float(found[2]) < 1e-5, result.stdout


def test_multi_lora_training_benchmark_trains_every_adapter_in_one_pass_with_the_same_gradients():
    result = run_benchmark("multi_lora_training", "--shape", "tiny", "--adapters", "3", "--sequences", "2",
                           "--tokens", "16", "--repeats", "1")
    found = re.search(r"one pass is ([\d.]+)x the adapter-a-pass rate; largest log-prob difference (\S+), largest "
                      r"gradient difference (\S+) \(of gradients up to (\S+)\); gradients of the same weights: True",
                      result.stdout)
    assert found and float(found[1]) > 0 and float(found[2]) < 1e-5, result.stdout
    assert float(found[3]) < 1e-5 * float(found[4]), result.stdout
