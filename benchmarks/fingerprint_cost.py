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

import argparse
import copy
import tempfile
import time

import torch
from transformers import CLIPVisionConfig, CLIPVisionModel

import hf_featcal.calibrator as calibrator_module
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
    size = sum(p.numel() * p.element_size() for p in base.parameters())
    print(f"tower: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters ({size / 2**20:.0f} MiB) per model; "
          f"{args.samples} images per task, {args.threads} threads")

    with tempfile.TemporaryDirectory() as root:
        folders = {}
        for task, expert in experts.items():
            expert.save_pretrained(f"{root}/{task}")
            folders[task] = f"{root}/{task}"
        for label, sources in (("in-memory experts", experts), ("experts as folders", folders)):
            timings = {"fingerprint": 0.0}
            original = calibrator_module.fingerprint

            def timed(parts, _original=original):
                start = time.perf_counter()
                parts = list(parts)  # the parts (also the experts' file digests) are built by the caller
                out = _original(parts)
                timings["fingerprint"] += time.perf_counter() - start
                return out

            calibrator_module.fingerprint = timed
            try:
                model = copy.deepcopy(merged)
                start = time.perf_counter()
                calibrator = FeatCalCalibrator(model, base, sources, data, FeatCalConfig(num_samples_per_task=None),
                                               show_progress=False, checkpoint_dir=f"{root}/ckpt-{label[:2]}")
                folder_method = calibrator._checkpoint_folder

                def timed_folder():
                    begin = time.perf_counter()
                    fingerprint_before = timings["fingerprint"]
                    out = folder_method()
                    # the run digest: the whole method (reads parameters, hashes files), counted once
                    timings["fingerprint"] = fingerprint_before + time.perf_counter() - begin
                    return out

                calibrator._checkpoint_folder = timed_folder
                calibrator.calibrate()
                total = time.perf_counter() - start
            finally:
                calibrator_module.fingerprint = original
            fp = timings["fingerprint"]
            print(f"{label}: fingerprint {fp:.3f} s of a {total:.1f} s run = {100 * fp / total:.2f} %")


if __name__ == "__main__":
    main()
