"""Cost of the SHA-256 digests that guard a checkpoint (block files at commit and at resume, streams
files' contents) against the run with `checkpoint_dir`.

    .venv/bin/python benchmarks/checkpoint_digest_cost.py [--layers 12] [--hidden 768] [--samples 16] [--threads 2]

A CLIP ViT-B/32-shaped vision tower (random weights), two experts. Prints the run's time, its
checkpointing stage and the seconds spent hashing, then the same for resuming the finished
checkpoint (every block file verified, then written).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import torch
from transformers import CLIPVisionConfig, CLIPVisionModel

import hf_featcal.checkpointing as checkpointing
from hf_featcal import FeatCalCalibrator, FeatCalConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=max(1, args.hidden // 64), image_size=224, patch_size=32)
    base = CLIPVisionModel(config).eval()
    experts = {}
    for i, task in enumerate(("a", "b")):
        expert = copy.deepcopy(base)
        generator = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
        experts[task] = expert
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.copy_(sum(e.get_parameter(name) for e in experts.values()) / len(experts))
    generator = torch.Generator().manual_seed(0)
    data = {t: [{"pixel_values": torch.randn(args.samples, 3, 224, 224, generator=generator)}] for t in experts}

    spent = {"block files": 0.0, "streams": 0.0}

    def timed(function, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = function(*a, **k)
            spent[key] += time.perf_counter() - start
            return out

        return wrapper

    checkpointing.file_digest = timed(checkpointing.file_digest, "block files")
    checkpointing._streams_digest = timed(checkpointing._streams_digest, "streams")
    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "ckpt")
        for label in ("run", "resume of the finished checkpoint"):
            spent.update(dict.fromkeys(spent, 0.0))
            start = time.perf_counter()
            calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, FeatCalConfig(num_samples_per_task=None),
                                           show_progress=False, checkpoint_dir=folder)
            calibrator.calibrate()
            total = time.perf_counter() - start
            hashing = sum(spent.values())
            print(f"{label}: {total:.1f} s, checkpointing stage {calibrator.timings.get('checkpointing', 0.0):.2f} s, "
                  f"SHA-256 {hashing:.2f} s ({100 * hashing / total:.2f} %: block files {spent['block files']:.2f} s, "
                  f"streams {spent['streams']:.2f} s)")
        sizes = {name: os.path.getsize(os.path.join(folder, name)) / 2**20 for name in sorted(os.listdir(folder))}
        print("files (MiB):", {name: round(size, 1) for name, size in sizes.items() if not name.startswith("block-") or name.endswith("1.safetensors")})


if __name__ == "__main__":
    main()
