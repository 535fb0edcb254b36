"""Cost of the exact resume fingerprint (content hash of the merged tower, experts, base and data)
against the calibration run it guards.

    .venv/bin/python benchmarks/fingerprint_cost.py [--layers 12] [--hidden 768] [--samples 16] [--threads 2]

A CLIP ViT-B/32-shaped vision tower (random weights), two experts and the base, in memory and as
safetensors folders (read lazily; their files are hashed). Prints the seconds spent fingerprinting
(data digest at construction + the run digest at the start of `calibrate()`) and the whole run
with `checkpoint_dir`, and their ratio. Few samples make the run short, so the ratio is an upper
bound for real runs (256 samples per task, more tasks).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported from elsewhere

import hf_featcal.calibrator as calibrator_module
from bench_common import clip_tower_run, timing_calls
from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.checkpointing import DigestBuilder


def main() -> None:
    run = clip_tower_run()
    size = sum(p.numel() * p.element_size() for p in run.base.parameters())
    print(
        f"tower: {sum(p.numel() for p in run.base.parameters()) / 1e6:.1f} M parameters ({size / 2**20:.0f} MiB) per "
        "model; "
        f"{run.args.samples} images per task, {run.args.threads} threads"
    )

    # the data digest at construction (built task by task as the batches are read), and the run digest at
    # the start of `calibrate()` as a whole (reads parameters, hashes expert files); neither call holds the other
    digests = {"data digest": (DigestBuilder, "add_all"), "run digest": (calibrator_module, "open_checkpoint")}
    with tempfile.TemporaryDirectory() as root:
        folders = {}
        for task, expert in run.experts.items():
            expert.save_pretrained(f"{root}/{task}")
            folders[task] = f"{root}/{task}"
        for label, sources in (("in-memory experts", run.experts), ("experts as folders", folders)):
            model = copy.deepcopy(run.merged)
            with timing_calls(digests) as spent:
                start = time.perf_counter()
                calibrator = FeatCalCalibrator(model, run.base, sources, run.data,
                                               FeatCalConfig(num_samples_per_task=None),
                                               show_progress=False, checkpoint_dir=f"{root}/ckpt-{label[:2]}")
                calibrator.calibrate()
                total = time.perf_counter() - start
            fp = sum(spent.values())
            print(f"{label}: fingerprint {fp:.3f} s of a {total:.1f} s run = {100 * fp / total:.2f} % "
                  f"(data digest {spent['data digest']:.3f} s, run digest {spent['run digest']:.3f} s)")


if __name__ == "__main__":
    main()
