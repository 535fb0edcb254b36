#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the CPU build of PyTorch
# (installed first, so nothing pulls a multi-GB CUDA build) and hf_featcal with its test and demo extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,demo]"
