#!/usr/bin/env bash
# FeatCal on one H200: the official-demo geometry (CLIP ViT-B/32 vision tower, 12 blocks, 224² images,
# 8 tasks × 256 calibration images, batches of 16) in exact mode (model float32, forward dtype none) and
# in fast mode (model float32, FeatCalConfig.forward_dtype="bfloat16"), each as one bench_clip.py run.
# Prints per run the per-stage table (seconds, TFLOP, TFLOP/s, fraction of the measured matmul peak of
# the stage's dtype), peak GPU memory and peak RSS, then a two-line comparison. Budget: under 10 minutes
# (preparation ≈ 1 min, each run ≈ 1–2 min; every step has its own `timeout`).
#
#     bash benchmarks/gpu_h200.sh            # on the GPU machine, from the repository root
#     bash benchmarks/gpu_h200.sh --smoke    # the same steps on the CPU with 2 blocks × 2 tasks × 4 images (< 1 min)
#
# Set-up: the repository's venv from `bash scripts/setup.sh`. On x86_64 it installs torch==2.14.1 from
# PyPI, which is the CUDA build (torch 2.14.1+cu130 with the nvidia-* wheels), so the same venv runs on
# the GPU. If the venv holds a CPU-only torch instead, install the CUDA one first:
#     .venv/bin/python -m pip install "$TORCH_CUDA_SPEC"      # default: torch==2.14.1 (PyPI's CUDA build)
# (torchvision must stay the matching 0.29.1; see scripts/setup.sh.) Without a .venv (a machine with no
# package index, whose python3 already holds CUDA torch, transformers, accelerate and safetensors) the
# script uses `python3`; $PYTHON overrides both. hf_featcal is always taken from this checkout's src/.
#
# Results: with $OUT set (the device tool copies $OUT back) the JSON of each run, the log and the
# machine description are written there; otherwise to a temporary folder printed at the end.
# Models are written once to $WORKDIR (default /tmp/hf_featcal_bench_h200) and reused by both runs.
set -uo pipefail
cd "$(dirname "$0")/.."

TORCH_CUDA_SPEC=${TORCH_CUDA_SPEC:-torch==2.14.1}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SMOKE=0
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        *) echo "unknown option: $arg (expected --smoke)" >&2; exit 2 ;;
    esac
done

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu LAYERS=2 TASKS=2 SAMPLES=4 BATCH_SIZE=4
    PREPARE_TIMEOUT=60 RUN_TIMEOUT=120
    WORKDIR=${WORKDIR:-/tmp/hf_featcal_bench_smoke}
else
    DEVICE=cuda LAYERS=12 TASKS=8 SAMPLES=256 BATCH_SIZE=${BATCH_SIZE:-16}
    PREPARE_TIMEOUT=${PREPARE_TIMEOUT:-150} RUN_TIMEOUT=${RUN_TIMEOUT:-200}
    WORKDIR=${WORKDIR:-/tmp/hf_featcal_bench_h200}
fi
RESULTS=${OUT:-$(mktemp -d /tmp/hf_featcal_h200.XXXXXX)}
mkdir -p "$RESULTS" "$WORKDIR"

if ! command -v "$PYTHON" > /dev/null; then
    echo "no Python at $PYTHON: run 'bash scripts/setup.sh' first" >&2
    exit 3
fi
"$PYTHON" - "$DEVICE" > "$RESULTS/machine.txt" 2>&1 <<'EOF'
import platform, sys
import torch
import transformers
import hf_featcal
print("python", sys.executable, platform.python_version(), "· torch", torch.__version__, "· CUDA build", torch.version.cuda,
      "· transformers", transformers.__version__, "· hf_featcal from", hf_featcal.__file__)
print("CPU threads", torch.get_num_threads())
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        print("no CUDA device is visible" if torch.version.cuda else "this torch is a CPU-only build")
        sys.exit(3)
    p = torch.cuda.get_device_properties(0)
    print("GPU", p.name, f"· {p.total_memory / 2**30:.0f} GiB", "· capability", f"{p.major}.{p.minor}")
    print("torch.mm(..., out_dtype=) on CUDA:", end=" ")
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    try:
        print(torch.mm(a, a, out_dtype=torch.float32).dtype)
    except (RuntimeError, TypeError) as err:
        print("unavailable", type(err).__name__)
EOF
status=$?
cat "$RESULTS/machine.txt"
if [ "$status" != 0 ]; then
    echo "no usable CUDA device (a CPU-only torch? install the CUDA build: $PYTHON -m pip install \"$TORCH_CUDA_SPEC\")" >&2
    exit 3
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv >> "$RESULTS/machine.txt" 2>/dev/null || true

echo "== preparing $TASKS experts × $LAYERS blocks in $WORKDIR (timeout ${PREPARE_TIMEOUT}s)"
start=$(date +%s)
timeout "$PREPARE_TIMEOUT" "$PYTHON" -c "
import sys; sys.path.insert(0, 'benchmarks')
from bench_clip import _Library, prepare
prepare('$WORKDIR', $TASKS, $LAYERS, _Library('transformers', $LAYERS))
" > "$RESULTS/prepare.log" 2>&1 || { echo "preparation failed or timed out; last lines:" >&2; tail -n 20 "$RESULTS/prepare.log" >&2; exit 4; }
echo "prepared in $(( $(date +%s) - start )) s"

failed=0
for mode in none bfloat16; do
    echo "== forward dtype $mode (timeout ${RUN_TIMEOUT}s)"
    start=$(date +%s)
    timeout "$RUN_TIMEOUT" "$PYTHON" benchmarks/bench_clip.py --device "$DEVICE" --dtype float32 --forward-dtype "$mode" \
        --layers "$LAYERS" --tasks "$TASKS" --samples "$SAMPLES" --batch-size "$BATCH_SIZE" \
        --workdir "$WORKDIR" --output "$RESULTS/bench_$mode.json" > "$RESULTS/bench_$mode.log" 2>&1
    rc=$?
    # the per-stage table and the summary line (the JSON is in the .json file and the log)
    sed -n '/^transformers · /,/^total /p' "$RESULTS/bench_$mode.log"
    if [ "$rc" != 0 ]; then
        failed=1
        echo "forward dtype $mode: exit status $rc ($( [ "$rc" = 124 ] && echo "timed out" || echo failed)) after $(( $(date +%s) - start )) s; last lines:" >&2
        tail -n 20 "$RESULTS/bench_$mode.log" >&2
    fi
done

"$PYTHON" - "$RESULTS" <<'EOF' | tee "$RESULTS/summary.md"
import json, os, sys
rows = {}
for mode in ("none", "bfloat16"):
    path = os.path.join(sys.argv[1], f"bench_{mode}.json")
    if os.path.exists(path):
        with open(path) as handle:
            rows[mode] = json.load(handle)[-1]
print("\n| mode | seconds | TFLOP | TFLOP/s (counted stages) | fraction of peak | peak GPU (GiB) | peak RSS (GiB) | last-block drift after/before |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for mode, r in rows.items():
    counted = [k for k in r["tflop"] if r["seconds_per_stage"].get(k)]
    tflop = sum(r["tflop"][k] for k in counted)
    seconds = sum(r["seconds_per_stage"][k] for k in counted)
    gpu = "-" if r["peak_device_gib"] is None else f"{r['peak_device_gib']:.2f}"
    before, after = r["last_block_drift_before_after"]
    print(f"| {'exact' if mode == 'none' else 'fast (' + mode + ')'} | {r['seconds_total']:.1f} | {tflop:.1f} | {tflop / seconds:.2f} | "
          f"{r['block_work_fraction_of_matmul_peak']:.3f} | {gpu} | {r['peak_rss_gib']:.2f} | {after / before:.3f} |")
if len(rows) == 2:
    print(f"\nfast vs exact: {rows['none']['seconds_total'] / rows['bfloat16']['seconds_total']:.2f}× faster")
EOF
echo "results in $RESULTS"
exit "$failed"
