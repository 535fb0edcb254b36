"""Benchmark: FeatCal on a CLIP ViT-B/32-geometry vision tower (random init, synthetic task vectors).

Prints (JSON, then a table) seconds per stage, the arithmetic count per stage (`flop_count`), the
achieved fraction of this machine's measured matmul peak for the dtype each stage runs in (forwards:
the forward dtype; statistics: float32, or the forward dtype in fast mode; solving: float32), peak
RSS and peak device memory (GPU). Experts and the base are written
to disk once (`--workdir`) and read block by block, as users' hub checkpoints are.

    python benchmarks/bench_clip.py --tasks 8 --samples 32                 # one run
    python benchmarks/bench_clip.py --sweep 1,2,4,8 --samples 32           # memory vs number of experts
    python benchmarks/bench_clip.py --forward-dtype bfloat16 --tasks 8 --samples 32   # fast mode
    python benchmarks/bench_clip.py --device cuda --tasks 8 --samples 256 --forward-dtype bfloat16   # GPU
    bash benchmarks/gpu_h200.sh                                             # both modes on one H200
    python benchmarks/bench_clip.py --library open_clip --tasks 8 --samples 32   # open_clip ViT-B-32 folders

Each measured run is its own process, so peak RSS is that run's alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported from elsewhere

from bench_common import (
    low_products_in_use,
    matmul_throughput,
    peak_rss_gib,
    rate_report,
    stage_dtypes,
    syrk_in_use,
    triangle_fraction,
)
from bench_common import stage_table as common_stage_table

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
    Only one expert is in memory at a time. Experts already written for the same number of layers
    (by a run with at least as many tasks) are reused; a workdir prepared for another number of layers
    is overwritten."""
    marker = os.path.join(workdir, f"ready-{tasks}-{layers}.json")
    if os.path.exists(marker):
        return
    reusable = 0  # experts 0 .. reusable-1 were written for this number of layers
    for name in os.listdir(workdir):
        match = re.fullmatch(r"ready-(\d+)-(\d+)\.json", name)
        if match is None:
            continue
        if int(match[2]) == layers:
            reusable = max(reusable, int(match[1]))
        else:  # its experts are about to be overwritten
            os.remove(os.path.join(workdir, name))
    torch.manual_seed(0)
    base = library.build()
    if library.name == "open_clip" and layers != len(base.visual.transformer.resblocks):
        base.visual.transformer.resblocks = base.visual.transformer.resblocks[:layers]
    library.save(base, os.path.join(workdir, "base"))
    original = {k: v.clone() for k, v in base.state_dict().items()}
    merged = {k: v.clone() for k, v in original.items()}
    for i in range(tasks):
        gen = torch.Generator().manual_seed(1000 + i)
        expert = {
            k: v + 0.02 * v.std().clamp_min(1e-3) * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
            for k, v in original.items()
        }
        for k, v in expert.items():
            if v.is_floating_point():
                merged[k] += 0.3 * (v - original[k])
        path = os.path.join(workdir, f"expert-{i}")
        if i >= reusable or not os.path.isdir(path):
            base.load_state_dict(expert)
            library.save(base, path)
        del expert
    base.load_state_dict(merged)
    library.save(base, os.path.join(workdir, f"merged-{tasks}"))
    with open(marker, "w") as handle:
        json.dump({"tasks": tasks}, handle)


def flop_count(
    tasks: int,
    samples: int,
    layers: int,
    d: int = 768,
    ff: int = 3072,
    tokens: int = 50,
    gram_fraction: float | None = None,
    exact: bool = True,
    syrk: bool = False,
) -> dict[str, float]:
    """Arithmetic (2 × multiply-adds) of one FeatCal run with the default settings, per timed stage,
    as the library does it.

    `gram_fraction`: the share of a full Gram product counted for every Gram; None: per input width as
    the library computes it (`triangle_fraction`): with `syrk` (`syrk_in_use`) the upper triangle of
    every unit-weight Gram, ~1/2 — all but the last block's pooled-token-weighted groups, which stay
    blocked — else the block upper triangle, 5/8 at 768 and 9/16 at 3072. Cross moments E[x_s x_eᵀ]
    are not symmetric and count in full. `exact`: exact mode, where fc2's right-hand side comes from
    the expert's outputs once that pays (`hf_featcal.statistics.outputs_rhs_pays`, default α).
    """
    def gram(width: int, unit_weights: bool) -> float:
        share = triangle_fraction(width, syrk and unit_weights) if gram_fraction is None else gram_fraction
        return share * 2 * width * width

    gram_d, gram_ff = gram(d, True), gram(ff, True)  # unit token weights
    gram_d_pooled, gram_ff_pooled = gram(d, False), gram(ff, False)  # the last block's weighted groups
    m = tasks * samples * tokens  # token rows per stream
    attention = 4 * tokens * d
    block_forward = m * (2 * (4 * d * d + 2 * d * ff) + attention)
    merged_until_fc2 = m * (2 * (4 * d * d + d * ff) + attention)  # the merged pass stops at fc2's input
    # per token: Gram + cross moment (2·d²) of q/k/v, out_proj and fc1; fc2's Gram and its right-hand side
    # accumulated directly (projection x_t·W_iᵀ, then x_sᵀ·y: 2·ff·d each); the last block has one more
    # q/k/v-input group (k/v with their own token weights)
    from hf_featcal import FeatCalConfig

    try:
        from hf_featcal.statistics import outputs_rhs_pays
    except ImportError:  # a library from before that path (`compare_revisions.py` runs old ones)
        outputs_rhs_pays = None
    # fc2 from the expert's outputs: x_sᵀ·y_e per token, the Gram times W_iᵀ per task
    from_outputs = exact and outputs_rhs_pays is not None and outputs_rhs_pays(samples * tokens, ff,
                                                                               FeatCalConfig().teacher_alpha)
    fc2_rhs = 2 * ff * d if from_outputs else 4 * ff * d
    stats = (layers - 1) * m * (3 * (gram_d + 2 * d * d) + gram_ff + fc2_rhs)
    try:  # the last block's pooled weighting inside the statistics (libraries from before: weighted copies)
        from hf_featcal.statistics import PooledWeighting  # noqa: F401
        pooled_inside = True
    except ImportError:
        pooled_inside = False
    if pooled_inside:
        # every-token sums on unit weights, q's taken from k/v's; per pooled row, each weighted group's
        # products again (q/k/v-input, out_proj, fc1: Gram and cross moment; fc2: Gram and x_sᵀ·y_e)
        pooled_rows = m // tokens
        stats += m * (3 * (gram_d + 2 * d * d) + gram_ff + fc2_rhs)
        stats += pooled_rows * (3 * (gram_d_pooled + 2 * d * d) + gram_ff_pooled + fc2_rhs)
    else:  # weighted groups with their own products, and one more q/k/v-input group for k/v
        stats += m * (3 * (gram_d_pooled + 2 * d * d) + gram_ff_pooled + fc2_rhs) + m * (gram_d + 2 * d * d)
    fold = layers * tasks * 2 * d * d * (3 * d + d + ff)  # X_i W_iᵀ of the cross-moment groups
    if from_outputs:
        fold += layers * tasks * 2 * ff * ff * d
    chol = lambda n: n**3 / 3  # noqa: E731
    per_block = (
        3 * chol(d) + chol(ff)  # factorisations: q/k/v, out_proj, fc1 | fc2
        + 2 * d * d * (3 * d + d + ff) + 2 * ff * ff * d  # triangular solves
        + 3 * chol(d) + chol(ff)  # singularity checks
        + 2 * d * d * (3 * d + d + ff) + 2 * ff * ff * d  # objective decreases
    )
    # the drift report's examples per task (`drift_samples_per_task`; libraries from before it: all), and
    # the model's last block propagates only the batches of that sample (before: every batch)
    try:
        from hf_featcal.pipeline.capture import CapturedBlock
        given_from_capture = "student_as_given" in {field.name for field in dataclasses.fields(CapturedBlock)}
    except ImportError:
        given_from_capture = False
    limit = getattr(FeatCalConfig(), "drift_samples_per_task", samples)
    drift_share = 1.0 if limit is None else min(samples, limit) / samples
    last_propagation = drift_share if hasattr(FeatCalConfig(), "drift_samples_per_task") else 1.0
    # the first block's merged pass runs to the block's end for the drift sample's batches, whose outputs
    # are the merged-as-given stream there (libraries from before ran that stream's block 0 as well)
    first_block_fc2 = drift_share * m * 2 * d * ff if given_from_capture else 0.0
    given_blocks = layers - 1 if given_from_capture else layers
    return {
        "block forwards": layers * (merged_until_fc2 + block_forward) + first_block_fc2,  # merged (cut short) + expert
        "statistics": stats + fold,
        "solving": layers * per_block,
        "propagating": (layers - 1 + last_propagation) * block_forward,
        "drift (merged-as-given stream)": given_blocks * block_forward * drift_share,
    }


def stage_table(result: dict) -> str:
    """The per-stage table (`bench_common.stage_table`) under this run's description."""
    title = (
        f"{result['library']} · {result['tasks']} tasks × {result['samples_per_task']} samples · {result['layers']} "
        "layers · "
        f"{result['device']} · model {result['dtype']} · forward dtype {result['forward_dtype'] or 'none (exact)'}"
    )
    return common_stage_table(result, title)


def measure(args: argparse.Namespace) -> dict:
    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    library = _Library(args.library, args.layers)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    forward_dtype = None if args.forward_dtype == "none" else args.forward_dtype
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
        FeatCalConfig(
            num_samples_per_task=args.samples, stream_placement=args.stream_placement,
            # (only when set: libraries from before fast mode have no such field)
            **({} if forward_dtype is None else {"forward_dtype": forward_dtype}),
            **({"reuse_freed_cpu_memory": True} if args.reuse_freed_cpu_memory else {}),
        ),
        device=device, show_progress=False,
    )
    calibrator.profile = True
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    calibrator.calibrate()
    total = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    # memory first: the throughput probe below allocates its own matrices
    peak_rss = peak_rss_gib()
    peak_device = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    dtypes = stage_dtypes(args.dtype, forward_dtype, low_products_in_use(device, forward_dtype))
    peaks = {name: matmul_throughput(device, getattr(torch, name)) for name in sorted(set(dtypes.values()))}
    syrk = syrk_in_use(device, forward_dtype)
    flops = flop_count(args.tasks, args.samples, args.layers, gram_fraction=args.gram_fraction,
                       exact=forward_dtype is None, syrk=syrk)
    timings = calibrator.timings
    return {
        "library": args.library,
        "tasks": args.tasks,
        "samples_per_task": args.samples,
        "layers": args.layers,
        "device": str(device),
        "dtype": args.dtype,
        "forward_dtype": forward_dtype,
        "gram_fraction": (
            {"768": triangle_fraction(768, syrk), "3072": triangle_fraction(3072, syrk), "syrk": syrk}
            if args.gram_fraction is None else args.gram_fraction
        ),
        "seconds_total": total,
        "seconds_per_stage": timings,
        "peak_rss_gib": peak_rss,
        "minor_page_faults": faults,  # of calibrate() (`--reuse-freed-cpu-memory` keeps them down)
        "reuse_freed_cpu_memory": args.reuse_freed_cpu_memory,
        "peak_device_gib": peak_device,
        **rate_report(flops, timings, dtypes, peaks),
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
    parser.add_argument("--forward-dtype", default="none", choices=["none", "bfloat16", "float16"],
                        help="FeatCalConfig.forward_dtype: none (exact mode) or the fast mode's autocast dtype")
    parser.add_argument("--gram-fraction", type=float, default=None,
                        help="share of a full Gram product to count (default: as the library blocks each width)")
    parser.add_argument("--stream-placement", default="accelerator", choices=["accelerator", "cpu", "pinned_cpu"])
    parser.add_argument("--reuse-freed-cpu-memory", action="store_true",
                        help="FeatCalConfig(reuse_freed_cpu_memory=True): glibc keeps freed memory for the run")
    parser.add_argument("--library", default="transformers", choices=["transformers", "open_clip"],
                        help="CLIPVisionModel (transformers) or open_clip's ViT-B-32 CLIP (its vision tower)")
    parser.add_argument("--workdir", default=None, help="where models are written (default: a temp folder per library)")
    parser.add_argument("--sweep", default=None, help="comma-separated numbers of experts, e.g. 1,2,4,8")
    parser.add_argument("--output", default=None, help="also write the results (a JSON list) to this file")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write the models for these arguments to --workdir and stop")
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
    if args.prepare_only:
        return
    rows = []
    for tasks in counts:
        cmd = [sys.executable, __file__, "--measure", "--library", args.library, "--tasks", str(tasks),
               "--samples", str(args.samples), "--batch-size", str(args.batch_size), "--layers", str(args.layers),
               "--device", args.device, "--dtype", args.dtype, "--forward-dtype", args.forward_dtype,
               *([] if args.gram_fraction is None else ["--gram-fraction", repr(args.gram_fraction)]),
               "--stream-placement", args.stream_placement, "--workdir", args.workdir,
               *(["--reuse-freed-cpu-memory"] if args.reuse_freed_cpu_memory else [])]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout + run.stderr)
            raise SystemExit(f"the measured run ({tasks} experts) failed with exit status {run.returncode}")
        result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
        rows.append(result)
        print(json.dumps(result, indent=2), flush=True)
        print("\n" + stage_table(result) + "\n", flush=True)
        if args.output:
            with open(args.output, "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=2)
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
