"""What FeatCal's fast mode (`FeatCalConfig.forward_dtype`) costs in accuracy on the trained toy scenarios.

For each scenario (digits — the demo's —, seq2seq T5, causal Llama; built, trained and scored as in
`scenario_spread.py`, with the FeatCal settings the tests use) and seed, this calibrates the same Task
Arithmetic merge twice, in exact mode (forward_dtype None) and in fast mode (default bfloat16), and
reports the mean score over tasks of TA, FeatCal exact and FeatCal fast, fast − exact in points, the
relative difference of the calibrated parameters ‖P_fast − P_exact‖_F / ‖P_exact‖_F (max and mean over
every parameter tensor that exact-mode FeatCal changed), and the wall seconds of each calibration
(constructing the FeatCalCalibrator and `calibrate()`).
The issue's bar: |fast − exact| ≤ 0.5 points of mean score.

    python benchmarks/fast_mode.py                                   # digits, text, causal × seeds 0 1 2
    python benchmarks/fast_mode.py --scenarios digits --seeds 0 --forward-dtype float16

Builds are cached per scenario and seed under `--cache-dir` (default: a folder in the temp dir), so a
second run only calibrates and scores. Scores do not depend on timing; seconds on a shared machine are
only indicative.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenario_spread import SETTINGS, _featcal, _mean

#: |mean score of fast − exact| allowed by the issue, in points
SCORE_BAR = 0.5


def calibrated_parameter_differences(
    merged: torch.nn.Module, exact: torch.nn.Module, fast: torch.nn.Module
) -> dict[str, float]:
    """‖P_fast − P_exact‖_F / ‖P_exact‖_F for every parameter tensor that exact-mode FeatCal changed
    (those it calibrated), in float64."""
    before = dict(merged.named_parameters())
    fast_params = dict(fast.named_parameters())
    out = {}
    for name, p_exact in exact.named_parameters():
        if not p_exact.is_floating_point() or torch.equal(p_exact, before[name]):
            continue
        p_exact64, p_fast64 = p_exact.detach().double(), fast_params[name].detach().double()
        out[name] = float((p_fast64 - p_exact64).norm() / p_exact64.norm().clamp_min(1e-30))
    return out


def run_one(name: str, seed: int, forward_dtype: str, cache_dir: str | None) -> dict:
    """Both calibrations of one scenario and seed, scored."""
    setting = SETTINGS[name](seed, None if cache_dir is None else os.path.join(cache_dir, f"{name}-seed{seed}"))
    ta = setting.score(setting.merged)
    runs = {}
    for mode, config in (("exact", setting.config),
                         ("fast", dataclasses.replace(setting.config, forward_dtype=forward_dtype))):
        model = copy.deepcopy(setting.merged)
        dtypes = {n: (p.dtype, p.device) for n, p in model.named_parameters()}
        start = time.perf_counter()
        calibrated, drift = _featcal(model, setting.base, setting.experts, setting.data, config)
        seconds = time.perf_counter() - start
        changed = [n for n, p in calibrated.named_parameters() if (p.dtype, p.device) != dtypes[n]]
        if changed:
            raise RuntimeError(f"{mode} mode changed the dtype or device of {changed[:3]}")
        runs[mode] = dict(model=calibrated, seconds=seconds, score=setting.score(calibrated), drift=drift)
    diffs = calibrated_parameter_differences(setting.merged, runs["exact"]["model"], runs["fast"]["model"])
    if not diffs:
        raise RuntimeError(f"{name}, seed {seed}: exact-mode FeatCal changed no parameter")
    worst = max(diffs, key=diffs.get)
    return dict(
        scenario=name, seed=seed, forward_dtype=forward_dtype,
        ta=_mean(ta.values()),
        exact=_mean(runs["exact"]["score"].values()),
        fast=_mean(runs["fast"]["score"].values()),
        per_task={mode: runs[mode]["score"] for mode in runs},
        max_relative_difference=diffs[worst], worst_parameter=worst,
        mean_relative_difference=_mean(diffs.values()), calibrated_tensors=len(diffs),
        seconds_exact=runs["exact"]["seconds"], seconds_fast=runs["fast"]["seconds"],
        last_block_drift_after={mode: _mean(a for _, a in runs[mode]["drift"].values()) for mode in runs},
    )


def table(rows: list[dict]) -> str:
    """The per-run markdown table, then one line per scenario averaged over seeds."""
    lines = [
        "| scenario | seed | TA | FeatCal exact | FeatCal fast | fast − exact (pt) | rel. diff. W max | rel. diff. W "
        "mean | s exact | s fast |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['seed']} | {r['ta']:.2f} | {r['exact']:.2f} | {r['fast']:.2f} | "
            f"{r['fast'] - r['exact']:+.2f} | "
            f"{r['max_relative_difference']:.2e} | {r['mean_relative_difference']:.2e} | {r['seconds_exact']:.1f} | "
            f"{r['seconds_fast']:.1f} |"
        )
    lines.append("")
    lines.append(
        "| scenario | seeds | TA | exact | fast | fast − exact (pt) | max \\|fast − exact\\| (pt) | within 0.5 pt | "
        "rel. diff. W max |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        gaps = [r["fast"] - r["exact"] for r in mine]
        worst = max(abs(g) for g in gaps)
        lines.append(
            f"| {name} | {len(mine)} | {_mean(r['ta'] for r in mine):.2f} | {_mean(r['exact'] for r in mine):.2f} | "
            f"{_mean(r['fast'] for r in mine):.2f} | {_mean(gaps):+.2f} | {worst:.2f} | "
            f"{'yes' if worst <= SCORE_BAR else 'NO'} | "
            f"{max(r['max_relative_difference'] for r in mine):.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--forward-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the tests use 1)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "hf_featcal_fast_mode"),
                        help="where the scenario builds are cached ('' to build from scratch each time)")
    parser.add_argument("--output", help="also write the rows as JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.scenarios:
        for seed in args.seeds:
            row = run_one(name, seed, args.forward_dtype, args.cache_dir or None)
            if not all(math.isfinite(row[k]) for k in ("exact", "fast", "max_relative_difference")):
                raise RuntimeError(f"{name}, seed {seed}: non-finite result {row}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.output:
                with open(args.output, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row) + "\n")
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
