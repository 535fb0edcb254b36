"""Benchmark: FeatCal on a CLIP ViT-B/32-geometry vision tower (random init, synthetic task vectors).

Prints seconds per stage, peak RSS, peak device memory (GPU), the arithmetic count of the run and
the achieved fraction of this machine's measured matmul throughput. Experts and the base are written
to disk once (`--workdir`) and read block by block, as users' hub checkpoints are.

    python benchmarks/bench_clip.py --tasks 8 --samples 32                 # one run
    python benchmarks/bench_clip.py --sweep 1,2,4,8 --samples 32           # memory vs number of experts
    python benchmarks/bench_clip.py --device cuda --dtype bfloat16 --tasks 8 --samples 256   # GPU variant
    python benchmarks/bench_clip.py --library open_clip --tasks 8 --samples 32   # open_clip ViT-B-32 folders

Each measured run is its own process, so peak RSS is that run's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

VIT_B32 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               image_size=224, patch_size=32, num_channels=3)


def _config(layers: int):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(**{**VIT_B32, "num_hidden_layers": layers})


class _Library:
    """How the benchmark builds, saves and loads models of one library (transformers or open_clip)."""

    def __init__(self, name: str, layers: int) -> None:
        self.name, self.layers = name, layers

    def build(self) -> torch.nn.Module:
        if self.name == "transformers":
            from transformers import CLIPVisionModel

            return CLIPVisionModel(_config(self.layers)).eval()
        import open_clip

        return open_clip.create_model("ViT-B-32", force_quick_gelu=True).eval()  # the OpenAI ViT-B/32

    def save(self, model: torch.nn.Module, path: str) -> None:
        if self.name == "transformers":
            model.save_pretrained(path)
            return
        import open_clip

        from hf_featcal.architectures.openclip import CONFIG_ATTRIBUTE, OpenCLIPVisionLayerMap

        config = open_clip.get_model_config("ViT-B-32")
        config["quick_gelu"] = True
        config["vision_cfg"]["layers"] = self.layers
        setattr(model, CONFIG_ATTRIBUTE, {"model_cfg": config, "preprocess_cfg": {}})
        OpenCLIPVisionLayerMap().save_model(model, path)

    def reference(self, path: str) -> str:
        """How a saved model is named to the calibrator (a folder; open_clip: a `local-dir:` reference)."""
        return path if self.name == "transformers" else f"local-dir:{path}"

    def load(self, path: str, dtype: torch.dtype) -> torch.nn.Module:
        if self.name == "transformers":
            from transformers import CLIPVisionModel

            return CLIPVisionModel.from_pretrained(path, dtype=dtype).eval()
        from hf_featcal.architectures.openclip import load_open_clip

        return load_open_clip(path).to(dtype)


def prepare(workdir: str, tasks: int, layers: int, library: _Library) -> None:
    """Write base, `tasks` experts (base + a synthetic task vector) and their Task-Arithmetic merge.
    Only one expert is in memory at a time."""
    marker = os.path.join(workdir, f"ready-{tasks}-{layers}.json")
    if os.path.exists(marker):
        return
    torch.manual_seed(0)
    base = library.build()
    if library.name == "open_clip" and layers != len(base.visual.transformer.resblocks):
        base.visual.transformer.resblocks = base.visual.transformer.resblocks[:layers]
    library.save(base, os.path.join(workdir, "base"))
    original = {k: v.clone() for k, v in base.state_dict().items()}
    merged = {k: v.clone() for k, v in original.items()}
    for i in range(tasks):
        gen = torch.Generator().manual_seed(1000 + i)
        expert = {k: v + 0.02 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                  for k, v in original.items()}
        for k, v in expert.items():
            if v.is_floating_point():
                merged[k] += 0.3 * (v - original[k])
        path = os.path.join(workdir, f"expert-{i}")
        if not os.path.isdir(path):
            base.load_state_dict(expert)
            library.save(base, path)
        del expert
    base.load_state_dict(merged)
    library.save(base, os.path.join(workdir, f"merged-{tasks}"))
    with open(marker, "w") as handle:
        json.dump({"tasks": tasks}, handle)


def matmul_throughput(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 8) -> float:
    """This machine's matmul throughput (FLOP/s): the best of square products of a few sizes."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best


def flop_count(tasks: int, samples: int, layers: int, d: int = 768, ff: int = 3072, tokens: int = 50) -> dict[str, float]:
    """Arithmetic (2 × multiply-adds) of one FeatCal run with the default settings, per timed stage,
    as the library does it."""
    m = tasks * samples * tokens  # token rows per stream
    attention = 4 * tokens * d
    block_forward = m * (2 * (4 * d * d + 2 * d * ff) + attention)
    merged_until_fc2 = m * (2 * (4 * d * d + d * ff) + attention)  # the merged pass stops at fc2's input
    # per token: Gram + cross moment of q/k/v (2 groups in the last block), out_proj and fc1; fc2's Gram
    # and its right-hand side accumulated directly (x_t·W_iᵀ, then x_sᵀ·y)
    stats = layers * m * (3 * 4 * d * d + 2 * ff * ff + 4 * ff * d) + m * 4 * d * d
    fold = layers * tasks * 2 * d * d * (3 * d + d + ff)  # X_i W_iᵀ of the cross-moment groups
    chol = lambda n: n**3 / 3  # noqa: E731
    per_block = (
        3 * chol(d) + chol(ff)  # factorisations: q/k/v, out_proj, fc1 | fc2
        + 2 * d * d * (3 * d + d + ff) + 2 * ff * ff * d  # triangular solves
        + 3 * chol(d) + chol(ff)  # singularity checks
        + 2 * d * d * (3 * d + d + ff) + 2 * ff * ff * d  # objective decreases
    )
    return {
        "block forwards": layers * (merged_until_fc2 + block_forward),  # merged (cut short) + expert
        "statistics": stats + fold,
        "solving": layers * per_block,
        "propagating": layers * block_forward,
        "drift (merged-as-given stream)": (layers - 1) * block_forward,  # block 0: same as the student
    }


def measure(args: argparse.Namespace) -> dict:
    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    library = _Library(args.library, args.layers)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    merged = library.load(os.path.join(args.workdir, f"merged-{args.tasks}"), dtype)
    experts = {f"task{i}": library.reference(os.path.join(args.workdir, f"expert-{i}")) for i in range(args.tasks)}
    batch = args.batch_size
    data = {
        task: [{"pixel_values": torch.randn(min(batch, args.samples - s), 3, 224, 224, dtype=dtype)}
               for s in range(0, args.samples, batch)]
        for task in experts
    }
    calibrator = FeatCalCalibrator(
        merged, library.reference(os.path.join(args.workdir, "base")), experts, data,
        FeatCalConfig(num_samples_per_task=args.samples, stream_placement=args.stream_placement),
        device=device, show_progress=False,
    )
    calibrator.profile = True
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    calibrator.calibrate()
    total = time.perf_counter() - start
    peak = matmul_throughput(device, torch.float32 if dtype == torch.float32 else dtype)
    flops = flop_count(args.tasks, args.samples, args.layers)
    work = sum(calibrator.timings.get(k, 0.0) for k in flops)
    return {
        "library": args.library,
        "tasks": args.tasks,
        "samples_per_task": args.samples,
        "device": str(device),
        "dtype": args.dtype,
        "seconds_total": total,
        "seconds_per_stage": calibrator.timings,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "tflop": {k: v / 1e12 for k, v in flops.items()},
        "measured_matmul_tflops": peak / 1e12,
        "block_work_fraction_of_matmul_peak": sum(flops.values()) / work / peak if work else None,
        "fraction_of_matmul_peak_per_stage": {
            k: v / calibrator.timings[k] / peak for k, v in flops.items() if calibrator.timings.get(k)
        },
        "last_block_drift_before_after": [
            sum(s["before"][-1] for s in calibrator.report.tasks.values()) / args.tasks,
            sum(s["after"][-1] for s in calibrator.report.tasks.values()) / args.tasks,
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32, help="calibration examples per task")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--stream-placement", default="accelerator", choices=["accelerator", "cpu", "pinned_cpu"])
    parser.add_argument("--library", default="transformers", choices=["transformers", "open_clip"],
                        help="CLIPVisionModel (transformers) or open_clip's ViT-B-32 CLIP (its vision tower)")
    parser.add_argument("--workdir", default=None, help="where models are written (default: a temp folder per library)")
    parser.add_argument("--sweep", default=None, help="comma-separated numbers of experts, e.g. 1,2,4,8")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workdir is None:
        suffix = "" if args.library == "transformers" else f"_{args.library}"
        args.workdir = os.path.join(tempfile.gettempdir(), f"hf_featcal_bench{suffix}")
    os.makedirs(args.workdir, exist_ok=True)

    if args.measure:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return

    counts = [int(t) for t in args.sweep.split(",")] if args.sweep else [args.tasks]
    for tasks in counts:
        prepare(args.workdir, tasks, args.layers, _Library(args.library, args.layers))
    rows = []
    for tasks in counts:
        cmd = [sys.executable, __file__, "--measure", "--library", args.library, "--tasks", str(tasks), "--samples", str(args.samples),
               "--batch-size", str(args.batch_size), "--layers", str(args.layers), "--device", args.device,
               "--dtype", args.dtype, "--stream-placement", args.stream_placement, "--workdir", args.workdir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append(result)
        print(json.dumps(result, indent=2), flush=True)
    if len(rows) > 1:
        print("\n| experts | seconds | peak RSS (GiB) | peak device (GiB) | fraction of matmul peak |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            device_mem = f"{r['peak_device_gib']:.2f}" if r["peak_device_gib"] is not None else "-"
            print(f"| {r['tasks']} | {r['seconds_total']:.1f} | {r['peak_rss_gib']:.2f} | {device_mem} | "
                  f"{r['block_work_fraction_of_matmul_peak']:.2f} |")
        print(f"\npeak RSS, {rows[-1]['tasks']} vs {rows[0]['tasks']} experts: "
              f"{rows[-1]['peak_rss_gib'] / rows[0]['peak_rss_gib']:.2f}×")


if __name__ == "__main__":
    main()
