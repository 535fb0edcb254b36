"""Cost of the SHA-256 digests that guard a checkpoint (block files at commit and at resume, streams
files' contents) against the run with `checkpoint_dir`.

    .venv/bin/python benchmarks/checkpoint_digest_cost.py [--layers 12] [--hidden 768] [--samples 16] [--threads 2]

A CLIP ViT-B/32-shaped vision tower (random weights), two experts. Prints the run's time, its
checkpointing stage and the seconds spent hashing, then the same for resuming the finished
checkpoint (every block file verified, then written).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported from elsewhere

import hf_featcal.checkpointing as checkpointing
from bench_common import clip_tower_run, timing_calls
from hf_featcal import FeatCalCalibrator, FeatCalConfig


def main() -> None:
    run = clip_tower_run()

    digests = {"block files": (checkpointing, "file_digest"), "streams": (checkpointing, "_streams_digest")}
    with tempfile.TemporaryDirectory() as root, timing_calls(digests) as spent:
        folder = os.path.join(root, "ckpt")
        for label in ("run", "resume of the finished checkpoint"):
            spent.update(dict.fromkeys(spent, 0.0))
            start = time.perf_counter()
            calibrator = FeatCalCalibrator(copy.deepcopy(run.merged), run.base, run.experts, run.data,
                                           FeatCalConfig(num_samples_per_task=None), show_progress=False,
                                           checkpoint_dir=folder)
            calibrator.calibrate()
            total = time.perf_counter() - start
            hashing = sum(spent.values())
            print(f"{label}: {total:.1f} s, checkpointing stage {calibrator.timings.get('checkpointing', 0.0):.2f} s, "
                  f"SHA-256 {hashing:.2f} s ({100 * hashing / total:.2f} %: block files {spent['block files']:.2f} s, "
                  f"streams {spent['streams']:.2f} s)")
        sizes = {name: os.path.getsize(os.path.join(folder, name)) / 2**20 for name in sorted(os.listdir(folder))}
        print(
            "files (MiB):",
            {
                name: round(size, 1)
                for name, size in sizes.items()
                if not name.startswith("block-") or name.endswith("1.safetensors")
            },
        )


if __name__ == "__main__":
    main()
