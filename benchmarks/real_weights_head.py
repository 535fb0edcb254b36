"""Task Arithmetic + FeatCal on the real-weights scenario (default settings): each task's accuracy before
and after, beside the drift report's head measure (`head_before` / `head_after` of the last block) and
`rising_tasks()` — does the measure see the task that calibration hurts?

    python benchmarks/real_weights_head.py --cache-dir ~/.cache/hf_featcal [--seed 0]

Builds (or loads from the cache) the scenario of `hf-featcal compare --demo --real-weights`.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.scenarios.minilm import build_minilm_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default="~/.cache/hf_featcal")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples-per-task", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    scenario = build_minilm_scenario(seed=args.seed, cache_dir=args.cache_dir,
                                     calibration_samples=args.samples_per_task)
    merged = scenario.task_arithmetic(0.3)
    before = scenario.evaluate(merged)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrator = FeatCalCalibrator(merged, scenario.base, scenario.experts, scenario.calibration,
                                       FeatCalConfig(num_samples_per_task=args.samples_per_task), show_progress=False)
        model = calibrator.calibrate()
    print(f"calibrate: {time.perf_counter() - start:.1f} s")
    after = scenario.evaluate(model)
    print("| task | TA | TA + FeatCal | head measure, last block: before → after |")
    print("|---|---|---|---|")
    for task in scenario.tasks:
        entry = calibrator.report.tasks[task]
        print(f"| {task} | {100 * before[task]:.1f} | {100 * after[task]:.1f} | "
              f"{entry['head_before'][-1]:.3f} → {entry['head_after'][-1]:.3f} |")
    print(f"rising_tasks(): {calibrator.report.rising_tasks()}")


if __name__ == "__main__":
    main()
