"""How much the real-weights scenario's scores move with the seed: the spread behind the thresholds of
tests/test_real_weights.py.

For each seed this builds the MiniLM scenario from scratch (no cache) with the settings the test uses
(`QUICK_SETTINGS`, or the full defaults with --full), scores the experts, the Task Arithmetic merge (0.3)
and TA + FeatCal (default `FeatCalConfig`), and prints one JSON line per seed, then the min / max of
every quantity the test asserts on.

    python benchmarks/real_weights_spread.py --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.scenarios.minilm import QUICK_SETTINGS, build_minilm_scenario


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def one_seed(seed: int, full: bool) -> dict:
    start = time.perf_counter()
    scenario = build_minilm_scenario(seed=seed, **({} if full else QUICK_SETTINGS))
    built = time.perf_counter() - start
    merged = scenario.task_arithmetic(0.3)
    ta = {t: 100 * v for t, v in scenario.evaluate(merged).items()}  # before: FeatCal calibrates `merged` in place
    cls_before = {t: scenario.cls_distance(merged, t) for t in scenario.tasks}
    n = min(sum(len(batch["input_ids"]) for batch in batches) for batches in scenario.calibration.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrator = FeatCalCalibrator(merged, scenario.base, scenario.experts, scenario.calibration,
                                       FeatCalConfig(num_samples_per_task=n), show_progress=False)
        calibrated = calibrator.calibrate()
    experts = {t: 100 * v for t, v in scenario.evaluate_experts().items()}
    featcal = {t: 100 * v for t, v in scenario.evaluate(calibrated).items()}
    cls_ratio = {t: scenario.cls_distance(calibrated, t) / cls_before[t] for t in scenario.tasks}
    drift_ratio = {
        t: [a / b for b, a in zip(d["before"], d["after"], strict=True)] for t, d in calibrator.report.tasks.items()
    }
    return {
        "seed": seed, "experts": experts, "ta": ta, "featcal": featcal,
        "mean_experts": _mean(experts.values()), "mean_ta": _mean(ta.values()), "mean_featcal": _mean(featcal.values()),
        "gain": _mean(featcal.values()) - _mean(ta.values()),
        "max_drift_ratio": max(max(r) for r in drift_ratio.values()),
        "cls_ratio": cls_ratio, "max_cls_ratio": max(cls_ratio.values()),
        "drift_ratio": drift_ratio, "seconds": round(time.perf_counter() - start, 1), "build_seconds": round(built, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for FeatCal and scoring")
    parser.add_argument("--full", action="store_true", help="the full default scenario instead of QUICK_SETTINGS")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        row = one_seed(seed, args.full)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for key in ("mean_experts", "mean_ta", "mean_featcal", "gain", "max_drift_ratio", "max_cls_ratio", "seconds"):
        values = [r[key] for r in rows]
        print(f"{key}: min {min(values):.3f} max {max(values):.3f}")


if __name__ == "__main__":
    main()
