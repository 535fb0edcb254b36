"""The authors' FeatCal demo and hf_featcal side by side, at the paper's scale, on the same models and images.

Both calibrate the same generated CLIP ViT-B/32-geometry tower (`bench_clip.prepare`: a random base, `--tasks`
experts = base + a synthetic task vector each, their Task-Arithmetic merge, written to `--workdir`) on the
same generated images (`--samples` per task in batches of `--batch-size`, each batch drawn from its own
seed), each in a process of its own, one after the other:

- the demo (`egangu/featcal`, `featcal.featcal.CLIPFeatCalibrator`): its experts, base and merged model
  loaded with its own loader, its `calibrate()` run as it is. Only two things are adapted from outside
  its code: its data loading (it reads the task's dataset from the hub) is pointed at the generated
  images, and a transformers 5 `CLIPVisionModel`, which holds its embeddings and encoder itself, is
  given the `.vision_model` the demo reads;
- hf_featcal: `FeatCalCalibrator` with its defaults (exact float32 mode, drift report on), the experts and
  the base read from their folders, the images given as an iterable of batches made as they are read.

It prints both times (the demo's `calibrate()`; hf_featcal's construction and `calibrate()`: model
loading is outside both), both peak RSS (each process's own `VmHWM`), their ratios and the relative
difference of the calibrated block weights.

    python benchmarks/side_by_side_demo.py --demo-path /tmp/featcal_demo               # 8 × 256, 3 blocks
    python benchmarks/side_by_side_demo.py --demo-path /tmp/featcal_demo --layers 12
    python benchmarks/side_by_side_demo.py --library-src /tmp/before/src ...           # another hf_featcal
    python benchmarks/side_by_side_demo.py --demo-path /tmp/featcal_demo --paired      # both at once, a core each
    python benchmarks/side_by_side_demo.py --demo-path /tmp/featcal_demo --rounds 3    # three pairs, medians
    python benchmarks/side_by_side_demo.py --demo-path /tmp/featcal_demo --count-products

With `--paired` both run at the same time, each pinned to its own half of the CPUs (as
`compare_revisions.py --paired` runs two revisions): on a machine shared with other work both then
see the same load, and the ratios are those of half-machine runs. With `--rounds N` it measures N pairs,
each round after the first in the other order (with `--paired`: on the other halves of the CPUs), prints
every pair and, over the rounds, each side's lowest, highest and median time and peak, the ratios of the
medians and the lowest and highest ratio of a single round: the demo's own time moves by several per
cent from run to run, so one pair's ratio lands on either side of its typical value.

With `--count-products`, after the timed rounds one more pair runs (one after the other) with every matrix
product counted as torch dispatches it (`bench_common.ProductCount`; hf_featcal with its Grams as torch
products, `HF_FEATCAL_CPU_GRAM=blocked`, which is already the choice on a CPU not made by Intel). The
script prints each side's product arithmetic, their ratio (the speed-up a run would show if both ran their
products equally fast and did nothing else) and, for every timed round, each side's arithmetic rate:
counted operations over its timed seconds. The counted runs' own times carry the counter's overhead and
are not compared.

The demo's code is imported from `--demo-path` (a folder holding the `featcal` package, or its `src`
folder) or, without it, from an installed `featcal` package; where neither is there, the script says so
and stops (exit status 0). `--library-src`: the folder holding the `hf_featcal` to measure (default:
this checkout's `src`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_clip import _Library, prepare  # noqa: E402  (this folder's modules, as the other benchmarks import them)
from bench_common import ProductCount, peak_rss_gib  # noqa: E402
from compare_revisions import THREAD_VARIABLES, _check_ran, _pinned_to, cpu_halves  # noqa: E402

DEMO_MODULE = "featcal.featcal"
GRAM_KERNEL_VARIABLE = "HF_FEATCAL_CPU_GRAM"  # hf_featcal's choice of Gram kernel on the CPU (`_kernels.gemm`)
DEMO_SOURCE = "https://github.com/egangu/featcal (src/featcal)"


def demo_root(demo_path: str | None) -> str | None:
    """The folder to put on `sys.path` so that `featcal.featcal` imports the demo ("" for an installed
    package), or None where the demo is not found."""
    if demo_path is not None:
        for root in (demo_path, os.path.join(demo_path, "src")):
            if os.path.isfile(os.path.join(root, "featcal", "featcal.py")):
                return os.path.abspath(root)
        return None
    try:
        return "" if importlib.util.find_spec(DEMO_MODULE) is not None else None
    except ImportError:  # no `featcal` package at all
        return None


def image_batch(task_index: int, batch_index: int, size: int) -> torch.Tensor:
    """The generated images of one batch: the same in both processes."""
    generator = torch.Generator().manual_seed(100_000 * (task_index + 1) + batch_index)
    return torch.randn(size, 3, 224, 224, generator=generator)


def batch_sizes(samples: int, batch_size: int) -> list[int]:
    return [min(batch_size, samples - start) for start in range(0, samples, batch_size)]


class GeneratedImages:
    """One task's images as an iterable of hf_featcal batches, each made when it is read."""

    def __init__(self, task_index: int, samples: int, batch_size: int) -> None:
        self.task_index, self.sizes = task_index, batch_sizes(samples, batch_size)

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        for b, size in enumerate(self.sizes):
            yield {"pixel_values": image_batch(self.task_index, b, size)}


def task_names(tasks: int) -> list[str]:
    return [f"task{i}" for i in range(tasks)]


def encoder_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The calibrated blocks' tensors, named as in hf_featcal's tower (`encoder.layers.…`)."""
    return {name[name.index("encoder."):]: value.detach().contiguous().clone()
            for name, value in model.state_dict().items() if "encoder.layers." in name}


def measured(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """What the timed part of a side's run runs under: the product count with `--count`, else nothing."""
    return ProductCount() if args.count else contextlib.nullcontext()


def counted(result: dict, measure: contextlib.AbstractContextManager) -> dict:
    """A side's result with its product count, where counted."""
    if isinstance(measure, ProductCount):
        result["products"] = measure.to_dict()
    return result


def run_demo(args: argparse.Namespace) -> dict:
    """The demo's own `calibrate()` on the generated images (see the module docstring for what is adapted)."""
    root = demo_root(args.demo_path)
    assert root is not None  # checked by the parent
    if root:
        sys.path.insert(0, root)
    demo = importlib.import_module(DEMO_MODULE)
    tasks = task_names(args.tasks)
    index = {task: i for i, task in enumerate(tasks)}

    # its data loading, pointed at the generated images: the "dataset" and "loader" of a task are its name
    demo.load_task_dataset = lambda task, split, cache_dir=None: task
    demo.make_clip_loader = lambda dataset, processor, **_: dataset
    demo.iter_limited_image_batches = lambda task, limit: [
        image_batch(index[task], b, size) for b, size in enumerate(batch_sizes(limit, args.batch_size))
    ]

    def readable(model: torch.nn.Module) -> torch.nn.Module:
        if not hasattr(model, "vision_model"):  # transformers 5: the tower is the model itself
            model.__class__ = type(type(model).__name__, (type(model),), {"vision_model": property(lambda self: self)})
        return model

    load = demo.load_vision_model
    merged = readable(load(os.path.join(args.workdir, f"merged-{args.tasks}")))
    base = readable(load(os.path.join(args.workdir, "base")))
    experts = {task: readable(m) for task, m in demo.load_expert_models(
        {task: os.path.join(args.workdir, f"expert-{i}") for i, task in enumerate(tasks)}).items()}
    config = demo.FeatCalConfig(num_calibration_examples=args.samples, calibration_batch_size=args.batch_size)
    calibrator = demo.CLIPFeatCalibrator(config, processor=None, device=torch.device("cpu"))
    start = time.perf_counter()
    with measured(args) as measure:
        calibrator.calibrate(merged_model=merged, base_model=base, expert_models=experts, tasks=tasks)
    seconds = time.perf_counter() - start
    return counted({"seconds": seconds, "peak_rss_gib": peak_rss_gib(), "weights": encoder_state(merged)}, measure)


def run_featcal(args: argparse.Namespace) -> dict:
    """hf_featcal with its defaults on the same models (experts and base read from their folders)."""
    from transformers import CLIPVisionModel

    import hf_featcal
    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    tasks = task_names(args.tasks)
    merged = CLIPVisionModel.from_pretrained(os.path.join(args.workdir, f"merged-{args.tasks}")).eval()
    experts = {task: os.path.join(args.workdir, f"expert-{i}") for i, task in enumerate(tasks)}
    data = {task: GeneratedImages(i, args.samples, args.batch_size) for i, task in enumerate(tasks)}
    fields = {field.name for field in dataclasses.fields(FeatCalConfig)}
    extra = {} if args.drift_samples is None or "drift_samples_per_task" not in fields else {
        "drift_samples_per_task": None if args.drift_samples == "all" else int(args.drift_samples)}
    config = FeatCalConfig(num_samples_per_task=args.samples, batch_size=args.batch_size, **extra)
    start = time.perf_counter()
    with measured(args) as measure:
        calibrator = FeatCalCalibrator(merged, os.path.join(args.workdir, "base"), experts, data, config,
                                       device="cpu", show_progress=False)
        calibrator.calibrate()
    seconds = time.perf_counter() - start
    report = calibrator.report.to_dict() if calibrator.report is not None else None
    return counted({
        "seconds": seconds, "peak_rss_gib": peak_rss_gib(), "weights": encoder_state(merged),
        "library": os.path.dirname(os.path.dirname(os.path.abspath(hf_featcal.__file__))),
        "stages": dict(calibrator.timings), "drift_sample": None if report is None else report.get("sample"),
        "config": {k: v for k, v in config.to_dict().items() if k in ("report_drift", "forward_dtype",
                                                                       "drift_samples_per_task")},
    }, measure)


def start(side: str, args: argparse.Namespace, folder: str, cpus: set[int] | None,
          count: bool = False) -> subprocess.Popen:
    """One side's run in a process of its own (pinned to `cpus` with as many threads, where given;
    with `count`, its products counted)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--run", side, "--out", os.path.join(folder, side),
           "--tasks", str(args.tasks), "--samples", str(args.samples), "--batch-size", str(args.batch_size),
           "--layers", str(args.layers), "--workdir", args.workdir,
           *(["--demo-path", args.demo_path] if args.demo_path else []),
           *(["--drift-samples", args.drift_samples] if args.drift_samples is not None else []),
           *(["--count"] if count else [])]
    env = dict(os.environ)
    if side == "featcal":
        env["PYTHONPATH"] = os.pathsep.join([args.library_src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if count:  # every Gram as a torch product, which the count sees (not MKL's syrk, called outside it)
            env[GRAM_KERNEL_VARIABLE] = "blocked"
    if cpus is not None:
        env.update({name: str(len(cpus)) for name in THREAD_VARIABLES})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=None if cpus is None else _pinned_to(cpus))


def finished(side: str, process: subprocess.Popen, folder: str) -> dict:
    """A side's result once its process has ended, with its weights read back."""
    from safetensors.torch import load_file

    stdout, stderr = process.communicate()
    _check_ran(f"the {side} run", process.returncode, stdout, stderr)
    out = os.path.join(folder, side)
    with open(out + ".json", encoding="utf-8") as handle:
        result = json.load(handle)
    result["weights"] = load_file(out + ".safetensors")
    return result


def relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict:
    """‖got − want‖ / ‖want‖ over every block tensor together, the largest per-tensor value and its name."""
    if got.keys() != want.keys():
        raise SystemExit(f"the two runs calibrated different tensors: {sorted(set(got) ^ set(want))[:5]}")
    difference = sum(float((got[k].double() - want[k].double()).norm()) ** 2 for k in want) ** 0.5
    size = sum(float(want[k].double().norm()) ** 2 for k in want) ** 0.5
    per_tensor = {k: float((got[k].double() - want[k].double()).norm() / want[k].double().norm().clamp_min(1e-30))
                  for k in want}
    worst = max(per_tensor, key=per_tensor.__getitem__)
    return {"total": difference / size, "largest_tensor": per_tensor[worst], "largest_tensor_name": worst}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=256, help="calibration images per task")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=3, help="blocks of the ViT-B/32-wide tower (12: the whole model)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hf_featcal_side_by_side"),
                        help="where the models are written (reused when they are there already)")
    parser.add_argument("--demo-path", default=None,
                        help="a folder holding the demo's `featcal` package (or its `src`); default: the installed one")
    parser.add_argument("--library-src", default=os.path.join(ROOT, "src"),
                        help="the folder holding the hf_featcal to measure (default: this checkout's src)")
    parser.add_argument("--drift-samples", default=None,
                        help="FeatCalConfig.drift_samples_per_task for hf_featcal ('all': None; default: its default)")
    parser.add_argument("--order", choices=["demo-first", "featcal-first"], default="demo-first")
    parser.add_argument("--paired", action="store_true",
                        help="run both at once, each pinned to half of the CPUs (the first named by --order on the "
                             "first half): on a machine shared with other work, both then see the same load")
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs (default 1); each round after the first swaps the order, and with "
                             "--paired the halves of the CPUs, of the one before; with more than one the script "
                             "also prints the medians over the rounds and their ratios")
    parser.add_argument("--count-products", action="store_true",
                        help="after the timed rounds, run one more pair with every matrix product counted, and "
                             "print both sides' product arithmetic, its ratio and each timed round's rates")
    parser.add_argument("--output", default=None, help="also write the results (JSON) here")
    parser.add_argument("--run", choices=["demo", "featcal"], help=argparse.SUPPRESS)
    parser.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run is not None:  # a measured process
        torch.manual_seed(0)
        with torch.no_grad():
            result = (run_demo if args.run == "demo" else run_featcal)(args)
        from safetensors.torch import save_file

        save_file(result.pop("weights"), args.out + ".safetensors")
        with open(args.out + ".json", "w", encoding="utf-8") as handle:
            json.dump(result, handle)
        return

    if args.rounds < 1:
        raise SystemExit(f"--rounds: at least one round, got {args.rounds}")
    if demo_root(args.demo_path) is None:
        where = f"in --demo-path {args.demo_path!r}" if args.demo_path else "installed (no `featcal` package)"
        print(f"skipped: the authors' demo ({DEMO_SOURCE}) is not {where}; give --demo-path, a folder holding its "
              "`featcal` package (featcal/featcal.py) or the repository's `src` folder.")
        return
    os.makedirs(args.workdir, exist_ok=True)
    prepare(args.workdir, args.tasks, args.layers, _Library("transformers", args.layers))
    load_before = os.getloadavg()
    first = ["demo", "featcal"] if args.order == "demo-first" else ["featcal", "demo"]
    rounds = [run_round(args, first if index % 2 == 0 else first[::-1]) for index in range(args.rounds)]
    products = count_products(args, rounds) if args.count_products else None
    load_after = os.getloadavg()
    summary = {
        "cpu": cpu_name(), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
        "case": {"tasks": args.tasks, "samples_per_task": args.samples, "batch_size": args.batch_size,
                 "layers": args.layers, "order": args.order, "paired": args.paired, "rounds": args.rounds},
        "load_average_before_after": [load_before, load_after],
    }
    # one round: its record at the top level, as before rounds existed
    summary.update(rounds[0] if args.rounds == 1 else {"rounds": rounds, "over_rounds": rounds_summary(rounds)})
    if products is not None:
        summary["products"] = products
    ours = rounds[0]["hf_featcal"]
    how = "at once, a half of the CPUs each" if args.paired else "one after the other"
    print(f"{summary['cpu']} ({summary['cpus']} CPUs), torch {summary['torch']}; {args.tasks} tasks × {args.samples} "
          f"images, batches of {args.batch_size}, {args.layers} blocks of CLIP ViT-B/32's widths, exact float32, "
          f"drift report on ({ours['config']}); the demo and hf_featcal {how}; load average before "
          f"{load_before[0]:.2f}, after {load_after[0]:.2f}")
    for index, result in enumerate(rounds):
        demo, ours, difference = result["demo"], result["hf_featcal"], result["weights_relative_difference"]
        if args.rounds > 1:
            print(f"\nround {index + 1}: {' then '.join(result['order']) if not args.paired else result['cpus']}")
        print("| | seconds | peak RSS (GiB) |\n|---|---:|---:|")
        print(f"| authors' demo | {demo['seconds']:.1f} | {demo['peak_rss_gib']:.2f} |")
        print(f"| hf_featcal ({ours['library']}) | {ours['seconds']:.1f} | {ours['peak_rss_gib']:.2f} |")
        print(f"hf_featcal: {result['speed_up']:.2f}× faster, {result['memory_ratio']:.2f}× leaner; calibrated weights "
              f"{difference['total']:.2e} relative apart over all blocks (largest per tensor "
              f"{difference['largest_tensor']:.2e}, {difference['largest_tensor_name']})")
        print("hf_featcal stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in ours["stages"].items()))
    if args.rounds > 1:
        over = summary["over_rounds"]
        print(f"\nover {args.rounds} rounds: the demo {over['demo_seconds_min']:.1f}–{over['demo_seconds_max']:.1f} s "
              f"(median {over['demo_seconds_median']:.1f}), hf_featcal {over['featcal_seconds_min']:.1f}–"
              f"{over['featcal_seconds_max']:.1f} s (median {over['featcal_seconds_median']:.1f}): "
              f"{over['speed_up_of_medians']:.2f}× faster on the medians, {over['speed_up_min']:.2f}–"
              f"{over['speed_up_max']:.2f}× per round; {over['memory_ratio_of_medians']:.2f}× leaner on the medians, "
              f"{over['memory_ratio_min']:.2f}–{over['memory_ratio_max']:.2f}× per round")
    if products is not None:
        print(products_text(products))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)


def count_products(args: argparse.Namespace, rounds: list[dict]) -> dict:
    """One more pair, one after the other, with every product counted: each side's count, their ratio
    and each timed round's rates (counted operations over that round's seconds)."""
    with tempfile.TemporaryDirectory(prefix="counts_", dir=args.workdir) as folder:
        results = {side: finished(side, start(side, args, folder, None, count=True), folder)
                   for side in ("demo", "featcal")}
    counts = {"demo": results["demo"]["products"], "hf_featcal": results["featcal"]["products"]}
    return products_summary(counts, rounds)


def products_summary(counts: dict[str, dict], rounds: list[dict]) -> dict:
    """`counts` (side → `ProductCount.to_dict()`) with the ratio of the totals (the demo's over
    hf_featcal's) and, per timed round, each side's rate in GFLOP/s."""
    demo, ours = counts["demo"]["flop"], counts["hf_featcal"]["flop"]
    rates = [{side: counts[side]["flop"] / result[side]["seconds"] / 1e9 for side in ("demo", "hf_featcal")}
             for result in rounds]
    return {**counts, "ratio": demo / ours, "gflop_per_s": rates}


def products_text(products: dict) -> str:
    """The printed account of `products_summary`."""
    demo, ours = products["demo"], products["hf_featcal"]

    def ops(count: dict) -> str:
        return ", ".join(f"{name} {flop / 1e12:.2f}" for name, flop in sorted(count["by_op"].items(),
                                                                                key=lambda item: -item[1]))

    lines = [f"\nmatrix products (TFLOP, counted as dispatched; solves not counted): the demo "
             f"{demo['flop'] / 1e12:.2f} ({ops(demo)}), hf_featcal {ours['flop'] / 1e12:.2f} ({ops(ours)}): "
             f"the demo does "
             f"{products['ratio']:.3f}× hf_featcal's arithmetic"]
    for index, rate in enumerate(products["gflop_per_s"]):
        lines.append(f"round {index + 1}: the demo ran its products' arithmetic at {rate['demo']:.1f} GFLOP/s, "
                     f"hf_featcal at {rate['hf_featcal']:.1f} GFLOP/s (counted operations over timed seconds)")
    return "\n".join(lines)


def run_round(args: argparse.Namespace, sides: list[str]) -> dict:
    """One pair of runs, `sides` in that order (with --paired: at once, the first on the first half of the
    CPUs): both records, their ratios and the calibrated weights' difference."""
    # (the runs' files go under --workdir: a shared machine's temp-folder sweeps have taken them from /tmp)
    with tempfile.TemporaryDirectory(prefix="runs_", dir=args.workdir) as folder:
        if args.paired:
            halves = cpu_halves()
            processes = {side: start(side, args, folder, cpus) for side, cpus in zip(sides, halves, strict=True)}
            results = {side: finished(side, processes[side], folder) for side in sides}
        else:
            results = {side: finished(side, start(side, args, folder, None), folder) for side in sides}
    demo, ours = results["demo"], results["featcal"]
    difference = relative_difference(ours.pop("weights"), demo.pop("weights"))
    record = {"order": sides, "demo": demo, "hf_featcal": ours, "speed_up": demo["seconds"] / ours["seconds"],
              "memory_ratio": demo["peak_rss_gib"] / ours["peak_rss_gib"], "weights_relative_difference": difference}
    if args.paired:
        record["cpus"] = {side: sorted(cpus) for side, cpus in zip(sides, halves, strict=True)}
    return record


def rounds_summary(rounds: list[dict]) -> dict:
    """Over the rounds: each side's lowest, highest and median time and peak, the ratios of the medians
    (the demo's over hf_featcal's), and the lowest and highest ratio of a single round."""
    def spread(values: list[float], name: str) -> dict:
        return {f"{name}_min": min(values), f"{name}_max": max(values), f"{name}_median": statistics.median(values)}

    demo_s = [r["demo"]["seconds"] for r in rounds]
    ours_s = [r["hf_featcal"]["seconds"] for r in rounds]
    demo_gib = [r["demo"]["peak_rss_gib"] for r in rounds]
    ours_gib = [r["hf_featcal"]["peak_rss_gib"] for r in rounds]
    speed_ups = [d / o for d, o in zip(demo_s, ours_s, strict=True)]
    memory_ratios = [d / o for d, o in zip(demo_gib, ours_gib, strict=True)]
    return {
        **spread(demo_s, "demo_seconds"), **spread(ours_s, "featcal_seconds"),
        **spread(demo_gib, "demo_peak_rss_gib"), **spread(ours_gib, "featcal_peak_rss_gib"),
        "speed_up_of_medians": statistics.median(demo_s) / statistics.median(ours_s),
        "speed_up_min": min(speed_ups), "speed_up_max": max(speed_ups),
        "memory_ratio_of_medians": statistics.median(demo_gib) / statistics.median(ours_gib),
        "memory_ratio_min": min(memory_ratios), "memory_ratio_max": max(memory_ratios),
    }

if __name__ == "__main__":
    main()
