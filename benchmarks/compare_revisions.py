"""Before/after timing of two library revisions on the CLIP benchmark, in alternating rounds.

One run of each is not a comparison on a shared machine: its speed drifts by ±10% within an hour,
and slow phases hit the two sides unequally. Here both revisions are measured by this checkout's
`bench_clip.py` (the same experts on disk, the same measurement code), only the library source
differs, and the runs alternate — before, after, before, after, ... — so that every round's ratio
compares two runs made minutes apart. Prints each round, then the mean, lowest and highest ratio.

    python benchmarks/compare_revisions.py --before d1f566f --rounds 3
    python benchmarks/compare_revisions.py --before 04c7124 --after HEAD --rounds 3 -- --forward-dtype bfloat16

With `--paired`, each round runs both revisions at the same time instead, each on its own half of
this process's CPUs (pinned, with as many BLAS/OpenMP threads as it has cores), trading halves
every round. A slow phase of the host then slows both sides at once. It is the ratio of half-machine
runs, which need not be the whole machine's, and it still moves: against d1f566f, four rounds on
this 2-core machine gave 1.23, 1.24, 1.30 and 1.24× (one core each, 8 × 32):

    python benchmarks/compare_revisions.py --before d1f566f --rounds 2 --paired

`--before` / `--after`: a git revision (its `src/` is exported into a temporary folder), or `.` for
this checkout's working tree (the default for `--after`). Arguments after `--` go to `bench_clip.py`
(default: the 8 tasks × 32 images case); both libraries must support what they ask for (fast mode's
`--forward-dtype` needs a library from 1da0690 on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKING_TREE = "."


def library_source(revision: str, into: str) -> str:
    """The folder holding `hf_featcal` at `revision` (this checkout's `src` for the working tree)."""
    if revision == WORKING_TREE:
        return os.path.join(ROOT, "src")
    target = os.path.join(into, revision.replace("/", "_"))
    os.makedirs(target, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "src"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--before/--after: git cannot export {revision!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", target], input=archive.stdout, check=True)
    return os.path.join(target, "src")


def measure(source: str, bench_args: list[str]) -> dict:
    """One `bench_clip.py` run with the library from `source`: its result (the last JSON list entry)."""
    return measure_together([(source, None)], bench_args)[0]


def measure_together(
    runs: list[tuple[str, set[int] | None]], bench_args: list[str], script: str | None = None
) -> list[dict]:
    """`bench_clip.py` runs (or `script`'s: it takes `--output FILE` and writes a JSON list there)
    started at once, one per (library source, CPUs), each pinned to its CPUs (None: not pinned)
    with that many BLAS/OpenMP threads; their results (the last list entry of each), in order."""
    script = script or os.path.join(HERE, "bench_clip.py")
    with tempfile.TemporaryDirectory(prefix="hf_featcal_runs_") as folder:
        started = []
        for index, (source, cpus) in enumerate(runs):
            output = os.path.join(folder, f"run-{index}.json")
            env = {**os.environ, "PYTHONPATH": source}
            if cpus is not None:
                env.update({name: str(len(cpus)) for name in THREAD_VARIABLES})
            process = subprocess.Popen(
                [sys.executable, script, *bench_args, "--output", output],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                preexec_fn=None if cpus is None else _pinned_to(cpus),
            )
            started.append((source, output, process))
        results = []
        for source, output, process in started:
            stdout, stderr = process.communicate()
            _check_ran(f"{os.path.basename(script)} with the library from {source}", process.returncode, stdout, stderr)
            with open(output, encoding="utf-8") as handle:
                results.append(json.load(handle)[-1])
        return results


def _check_ran(what: str, returncode: int, stdout: str, stderr: str) -> None:
    """Stop with the end of a failed run's output and its exit status."""
    if returncode != 0:
        sys.stderr.write(stdout[-4000:] + stderr[-4000:])
        raise SystemExit(f"{what} failed (exit status {returncode})")


#: the thread-count variables of torch's OpenMP, MKL and OpenBLAS (numpy's)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _pinned_to(cpus: set[int]):
    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def cpu_halves() -> tuple[set[int], set[int]]:
    """This process's CPUs in two halves of equal size (an odd one out is left idle)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--paired needs at least 2 CPUs, this process may use {len(cpus)}")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half : 2 * half])


def summary(rounds: list[tuple[dict, dict]]) -> dict:
    """Per-round seconds, ratios (before / after) and peak RSS, and the ratios' mean, lowest and highest."""
    ratios = [before["seconds_total"] / after["seconds_total"] for before, after in rounds]
    return {
        "rounds": [
            {
                "before_s": before["seconds_total"], "after_s": after["seconds_total"], "ratio": ratio,
                "before_rss_gib": before["peak_rss_gib"], "after_rss_gib": after["peak_rss_gib"],
            }
            for (before, after), ratio in zip(rounds, ratios, strict=True)
        ],
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision measured first in each round, or '.'")
    parser.add_argument("--after", default=WORKING_TREE, help="git revision measured second, or '.' (default)")
    parser.add_argument("--rounds", type=int, default=3, help="before/after pairs (default 3)")
    parser.add_argument("--paired", action="store_true",
                        help="run both revisions at once, each pinned to half of the CPUs (halves traded every round)")
    parser.add_argument("--output", default=None, help="also write the summary and every run's result (JSON) here")
    parser.add_argument("bench_args", nargs="*", help="arguments for bench_clip.py (after --)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    bench_args = args.bench_args  # (bench_clip.py defaults to the 8 tasks × 32 images case)
    with tempfile.TemporaryDirectory(prefix="hf_featcal_revisions_") as folder:
        sources = {side: library_source(getattr(args, side), folder) for side in ("before", "after")}
        halves = cpu_halves() if args.paired else None
        if args.paired:  # the models on disk first, so that the two runs do not both write them
            prepared = subprocess.run(
                [sys.executable, os.path.join(HERE, "bench_clip.py"), *bench_args, "--prepare-only"],
                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": sources["after"]},
            )
            _check_ran("bench_clip.py --prepare-only", prepared.returncode, prepared.stdout, prepared.stderr)
        rounds = []
        for index in range(1, args.rounds + 1):
            if halves is None:
                before = measure(sources["before"], bench_args)
                after = measure(sources["after"], bench_args)
            else:
                first, second = halves if index % 2 else halves[::-1]
                before, after = measure_together([(sources["before"], first), (sources["after"], second)], bench_args)
            rounds.append((before, after))
            print(
                f"round {index}: before ({args.before}) {before['seconds_total']:.2f} s, {before['peak_rss_gib']:.2f} "
                "GiB · "
                f"after ({args.after}) {after['seconds_total']:.2f} s, {after['peak_rss_gib']:.2f} GiB · "
                f"{before['seconds_total'] / after['seconds_total']:.3f}×",
                flush=True,
            )
    result = summary(rounds)
    print(
        f"ratio before/after: mean {result['ratio_mean']:.3f}×, lowest {result['ratio_min']:.3f}×, highest "
        f"{result['ratio_max']:.3f}×"
    )
    stages = sorted({stage for pair in rounds for run in pair for stage in run["seconds_per_stage"]})
    print("\n| stage | before (mean s) | after (mean s) |\n|---|---:|---:|")
    for stage in stages:
        means = [
            sum(pair[side]["seconds_per_stage"].get(stage, 0.0) for pair in rounds) / len(rounds) for side in (0, 1)
        ]
        print(f"| {stage} | {means[0]:.2f} | {means[1]:.2f} |")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(
                {**result, "before": args.before, "after": args.after, "paired": args.paired, "bench_args": bench_args,
                 "runs": rounds},
                handle, indent=2,
            )


if __name__ == "__main__":
    main()
