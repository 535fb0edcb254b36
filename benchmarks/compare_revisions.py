"""Before/after timing of two library revisions on the CLIP benchmark, in alternating rounds.

One run of each is not a comparison on a shared machine: its speed drifts by ±10% within an hour,
and slow phases hit the two sides unequally. Here both revisions are measured by this checkout's
`bench_clip.py` (the same experts on disk, the same measurement code), only the library source
differs, and the runs alternate — before, after, before, after, ... — so that every round's ratio
compares two runs made minutes apart. Prints each round, then the mean, lowest and highest ratio.

    python benchmarks/compare_revisions.py --before d1f566f --rounds 3
    python benchmarks/compare_revisions.py --before 04c7124 --after HEAD --rounds 3 -- --forward-dtype bfloat16

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
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        env = {**os.environ, "PYTHONPATH": source}
        run = subprocess.run(
            [sys.executable, os.path.join(HERE, "bench_clip.py"), *bench_args, "--output", output.name],
            capture_output=True, text=True, env=env,
        )
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            raise SystemExit(f"bench_clip.py with the library from {source} failed (exit status {run.returncode})")
        with open(output.name, encoding="utf-8") as handle:
            return json.load(handle)[-1]


def summary(rounds: list[tuple[dict, dict]]) -> dict:
    """Per-round seconds, ratios (before / after) and peak RSS, and the ratios' mean, lowest and highest."""
    ratios = [before["seconds_total"] / after["seconds_total"] for before, after in rounds]
    return {
        "rounds": [
            {
                "before_s": before["seconds_total"], "after_s": after["seconds_total"], "ratio": ratio,
                "before_rss_gib": before["peak_rss_gib"], "after_rss_gib": after["peak_rss_gib"],
            }
            for (before, after), ratio in zip(rounds, ratios)
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
    parser.add_argument("--output", default=None, help="also write the summary and every run's result (JSON) here")
    parser.add_argument("bench_args", nargs="*", help="arguments for bench_clip.py (after --)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    bench_args = args.bench_args  # (bench_clip.py defaults to the 8 tasks × 32 images case)
    with tempfile.TemporaryDirectory(prefix="hf_featcal_revisions_") as folder:
        sources = {side: library_source(getattr(args, side), folder) for side in ("before", "after")}
        rounds = []
        for index in range(1, args.rounds + 1):
            before = measure(sources["before"], bench_args)
            after = measure(sources["after"], bench_args)
            rounds.append((before, after))
            print(
                f"round {index}: before ({args.before}) {before['seconds_total']:.2f} s, {before['peak_rss_gib']:.2f} GiB · "
                f"after ({args.after}) {after['seconds_total']:.2f} s, {after['peak_rss_gib']:.2f} GiB · "
                f"{before['seconds_total'] / after['seconds_total']:.3f}×",
                flush=True,
            )
    result = summary(rounds)
    print(f"ratio before/after: mean {result['ratio_mean']:.3f}×, lowest {result['ratio_min']:.3f}×, highest {result['ratio_max']:.3f}×")
    stages = sorted({stage for pair in rounds for run in pair for stage in run["seconds_per_stage"]})
    print("\n| stage | before (mean s) | after (mean s) |\n|---|---:|---:|")
    for stage in stages:
        means = [sum(pair[side]["seconds_per_stage"].get(stage, 0.0) for pair in rounds) / len(rounds) for side in (0, 1)]
        print(f"| {stage} | {means[0]:.2f} | {means[1]:.2f} |")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump({**result, "before": args.before, "after": args.after, "bench_args": bench_args, "runs": rounds}, handle, indent=2)


if __name__ == "__main__":
    main()
