"""The benchmark runs end to end on tiny inputs and writes its table (no timing is asserted here)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.run", "--model", "tiny", "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
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
