"""The benchmark: llmrl against plain Hugging Face on RL-shaped workloads, and two narrower measurements.

Run from the repository root, as modules of this package (the servers a benchmark starts inherit that folder and
import :mod:`benchmarks.hooks` from it)::

    .venv/bin/python -m benchmarks.run --model tiny --quick   # the main table (see benchmarks/run.py)
    .venv/bin/python -m benchmarks.profile_scoring            # where an in-process score call's time goes
    .venv/bin/python -m benchmarks.frames_mac                 # the cost of the per-frame MAC

Not part of the installed ``llmrl`` package, and not imported by it; importing this package runs nothing.
"""
