"""Benchmark: peak RSS and seconds of FeatCal with the restore snapshot in host memory or on disk
(`FeatCalConfig.restore_snapshot`), on bench_clip's CLIP ViT-B/32-geometry case.

    python benchmarks/snapshot_memory.py                      # 2 tasks, 32 samples, 'memory' vs 'disk'
    python benchmarks/snapshot_memory.py --tasks 2 --repeats 2 --no-base

Each measured run is its own process; its peak RSS is the kernel's high-water mark of that process's
memory (`VmHWM`), not `ru_maxrss`, which a child started by `subprocess` (vfork + exec) inherits from
its parent's peak — here the parent that wrote the models. A sampler
thread also records, every few milliseconds, the process's anonymous and file-backed resident memory
and the resident pages of every file of the workdir that is memory-mapped (the base's, the experts'
and the merged model's safetensors files), to tell what the peak is made of. The disk snapshot is
written under TMPDIR (`--tmpdir`); on a tmpfs it still uses RAM, only not this process's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_clip import _Library, prepare

MIB = 2**20


def _status_mib() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process, in MiB."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(line.split()[1]) / 1024
    return values


def _mapped_files_mib(root: str) -> dict[str, float]:
    """Resident MiB of every memory-mapped file under `root` (from /proc/self/smaps)."""
    resident: dict[str, float] = {}
    current = None
    with open("/proc/self/smaps") as handle:
        for line in handle:
            first = line.split(maxsplit=5)
            if len(first) >= 5 and "-" in first[0] and not line.startswith(("Rss", "Size")) and ":" not in first[0]:
                current = first[5].strip() if len(first) == 6 and first[5].strip().startswith(root) else None
            elif current is not None and line.startswith("Rss:"):
                resident[current] = resident.get(current, 0.0) + int(line.split()[1]) / 1024
    return resident


class _Sampler(threading.Thread):
    """Peak anonymous / file-backed RSS and peak resident pages per mapped workdir file."""

    def __init__(self, root: str, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = os.path.realpath(root), interval
        self.peak = {"VmRSS": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
        self.at_peak: dict[str, float] = {}
        self.files: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status = _status_mib()
            status.pop("VmHWM")
            if status["VmRSS"] > self.peak["VmRSS"]:
                self.at_peak = status
            for key, value in status.items():
                self.peak[key] = max(self.peak[key], value)
            for path, value in _mapped_files_mib(self.root).items():
                name = os.path.relpath(path, self.root)
                self.files[name] = max(self.files.get(name, 0.0), value)
            time.sleep(self.interval)


def measure(args: argparse.Namespace) -> dict:
    import torch

    import hf_featcal.calibrator as calibrator_module
    from hf_featcal import FeatCalCalibrator, FeatCalConfig

    library = _Library("transformers", args.layers)
    sampler = _Sampler(args.workdir, args.sample_interval)
    if args.sample_interval > 0:
        sampler.start()
    torch.manual_seed(0)
    merged = library.load(os.path.join(args.workdir, f"merged-{args.tasks}"), torch.float32)
    experts = {f"task{i}": os.path.join(args.workdir, f"expert-{i}") for i in range(args.tasks)}
    data = {
        task: [
            {"pixel_values": torch.randn(min(16, args.samples - s), 3, 224, 224)} for s in range(0, args.samples, 16)
        ]
        for task in experts
    }
    after_load = _status_mib()
    snapshot: dict[str, float] = {}
    original = calibrator_module.restore_on_failure

    @contextlib.contextmanager
    def timed_restore_on_failure(*a, **k):  # seconds and RSS of taking the snapshot alone
        start = time.perf_counter()
        before = _status_mib()["VmRSS"]
        with original(*a, **k):
            snapshot["seconds"] = time.perf_counter() - start
            snapshot["rss_added_mib"] = _status_mib()["VmRSS"] - before
            yield

    calibrator_module.restore_on_failure = timed_restore_on_failure
    base = None if args.no_base else os.path.join(args.workdir, "base")
    calibrator = FeatCalCalibrator(
        merged, base, experts, data, FeatCalConfig(num_samples_per_task=args.samples, restore_snapshot=args.snapshot),
        device="cpu", show_progress=False,
    )
    start = time.perf_counter()
    calibrator.calibrate()
    seconds = time.perf_counter() - start
    sampler.stop.set()
    if sampler.is_alive():
        sampler.join()
    return {
        "snapshot": args.snapshot,
        "base": base is not None,
        "seconds": seconds,
        "snapshot_seconds": snapshot["seconds"],
        "snapshot_rss_added_mib": snapshot["rss_added_mib"],
        "rss_after_load_mib": after_load["VmRSS"],
        "peak_rss_mib": _status_mib()["VmHWM"],
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "sampled_peak_mib": sampler.peak,
        "sampled_at_peak_mib": sampler.at_peak,
        "peak_mapped_workdir_files_mib": sampler.files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting (the table shows each)")
    parser.add_argument("--no-base", action="store_true", help="calibrate without a base model (anchor: merged)")
    parser.add_argument("--workdir", default="/tmp/hf_featcal_bench")
    parser.add_argument("--tmpdir", default=None, help="TMPDIR of the measured runs (where 'disk' writes)")
    parser.add_argument("--sample-interval", type=float, default=0.005,
                        help="seconds between RSS / smaps samples; 0: no sampler thread (cleaner timings)")
    parser.add_argument("--snapshot", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.snapshot is not None:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    os.makedirs(args.workdir, exist_ok=True)
    prepare(args.workdir, args.tasks, args.layers, _Library("transformers", args.layers))
    env = dict(os.environ, **({"TMPDIR": args.tmpdir} if args.tmpdir else {}))
    rows = []
    for _ in range(args.repeats):
        for snapshot in ("memory", "disk"):
            cmd = [sys.executable, __file__, "--snapshot", snapshot, "--tasks", str(args.tasks), "--samples",
                   str(args.samples), "--sample-interval", str(args.sample_interval),
                   "--layers", str(args.layers), "--workdir", args.workdir, *(["--no-base"] if args.no_base else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            rows.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.tasks} tasks, {args.samples} samples/task, {args.layers} blocks, base: {not args.no_base}")
    print(
        "| snapshot | seconds | snapshot s | peak RSS (MiB) | anon at peak | file at peak | RSS after load | snapshot "
        "adds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        at = r["sampled_at_peak_mib"]
        print(f"| {r['snapshot']} | {r['seconds']:.1f} | {r['snapshot_seconds']:.2f} | {r['peak_rss_mib']:.0f} | "
              f"{at.get('RssAnon', 0):.0f} | {at.get('RssFile', 0):.0f} | {r['rss_after_load_mib']:.0f} | "
              f"{r['snapshot_rss_added_mib']:.0f} |")
    print("\npeak resident MiB of mapped workdir files:", json.dumps(rows[-1]["peak_mapped_workdir_files_mib"]))


if __name__ == "__main__":
    main()
