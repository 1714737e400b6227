"""The benchmark states every compute limit at the best matmul rate of its run (hand-computed values)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark_run", os.path.join(ROOT, "benchmarks", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_measured_at_a_slow_moment_gets_the_runs_best_rate():
    bench = load_benchmark()
    slow = {"workload": "a", "matmul GFLOP/s (best so far)": 100.0, "compute limit s": 8.0, "llmrl s": 6.0,
            "llmrl / limit": 0.75}
    fast = {"workload": "b", "matmul GFLOP/s (best so far)": 200.0, "compute limit s": 5.0, "llmrl / limit": 1.2}
    other = {"workload": "round trip", "median ms": 0.2}
    bench.rebase_limits([slow, fast, other], best=200e9)
    assert slow["compute limit s"] == 4.0 and slow["llmrl / limit"] == 1.5 and slow["llmrl s"] == 6.0
    assert slow["matmul GFLOP/s (best so far)"] == 200.0
    assert fast == {"workload": "b", "matmul GFLOP/s (best so far)": 200.0, "compute limit s": 5.0, "llmrl / limit": 1.2}
    assert other == {"workload": "round trip", "median ms": 0.2}
