"""How much the trained toy scenarios' scores move with the seed and the thread count.

Trained scenarios are not bit-identical across CPUs (other kernels round differently), so every
threshold the tests put on them must sit well outside the spread measured here. For each scenario
(digits / seq2seq / causal), seed and intra-op thread count this builds the scenario from scratch
(no cache), scores the base, the experts, the Task Arithmetic merge (0.3) and TA + FeatCal with the
settings the tests use, and prints one JSON line, then a summary (min / max per quantity).

    python benchmarks/scenario_spread.py --scenarios digits text causal --seeds 0 1 2 3 4 --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.merging import task_arithmetic

# the text scenarios are test fixtures: they live in tests/scenarios/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _featcal(merged, base, experts, data, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calibrator = FeatCalCalibrator(merged, base, experts, data, config, show_progress=False)
        calibrated = calibrator.calibrate()
    drift = {t: (d["before"][-1], d["after"][-1]) for t, d in calibrator.report.tasks.items()}
    return calibrated, drift


@dataclass
class Setting:
    """One trained scenario, ready for FeatCal with the settings the tests use: the base, the experts,
    their Task Arithmetic merge (0.3), the calibration data and config, and scores in points."""

    base: Any
    experts: dict[str, Any]
    merged: Any
    data: Any
    config: FeatCalConfig
    score: Callable[[Any], dict[str, float]]  # a model → its score per task
    expert_scores: Callable[[], dict[str, float]]  # each expert on its own task


def digits_setting(seed: int, cache_dir: str | None = None) -> Setting:
    from hf_featcal.scenarios.digits import build_digits_scenario

    s = build_digits_scenario(seed=seed, cache_dir=cache_dir)
    return Setting(
        s.base, s.experts, s.task_arithmetic(0.3), s.calibration, FeatCalConfig(num_samples_per_task=64),
        score=lambda model: {t: 100 * v for t, v in s.evaluate(model).items()},
        expert_scores=lambda: {t: 100 * v for t, v in s.evaluate_experts().items()},
    )


def _text_like_setting(s) -> Setting:
    return Setting(
        s.base,
        s.experts,
        task_arithmetic(s.base, s.experts, scaling_factor=0.3).eval(),
        s.calibration_batches,
        FeatCalConfig(),
        score=lambda model: {t: v for t, v in s.evaluate(model).items() if t != "mean"},
        expert_scores=lambda: {t: s.evaluate(e)[t] for t, e in s.experts.items()},
    )


def text_setting(seed: int, cache_dir: str | None = None) -> Setting:
    from scenarios.text import build_text_scenario

    return _text_like_setting(build_text_scenario(seed=seed, cache_dir=cache_dir))


def causal_setting(seed: int, cache_dir: str | None = None) -> Setting:
    from scenarios.causal import build_causal_scenario

    return _text_like_setting(build_causal_scenario(seed=seed, cache_dir=cache_dir))


SETTINGS: dict[str, Callable[..., Setting]] = {"digits": digits_setting, "text": text_setting, "causal": causal_setting}


def _spread_row(setting: Setting) -> dict:
    experts = setting.expert_scores()
    ta, base = setting.score(setting.merged), setting.score(setting.base)
    calibrated, drift = _featcal(setting.merged, setting.base, setting.experts, setting.data, setting.config)
    return dict(experts=experts, base=base, ta=ta, featcal=setting.score(calibrated), drift=drift)


def digits(seed: int) -> dict:
    return _spread_row(digits_setting(seed))


def text(seed: int) -> dict:
    return _spread_row(text_setting(seed))


def causal(seed: int) -> dict:
    return _spread_row(causal_setting(seed))


SCENARIOS = {"digits": digits, "text": text, "causal": causal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--output", help="also append the JSON lines to this file")
    args = parser.parse_args()
    rows = []
    for name in args.scenarios:
        for seed in args.seeds:
            for threads in args.threads:
                torch.set_num_threads(threads)
                start = time.perf_counter()
                row = dict(scenario=name, seed=seed, threads=threads, **SCENARIOS[name](seed))
                row["seconds"] = round(time.perf_counter() - start, 1)
                row["means"] = {k: round(_mean(row[k].values()), 2) for k in ("experts", "base", "ta", "featcal")}
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if args.output:
                    with open(args.output, "a", encoding="utf-8") as handle:
                        handle.write(line + "\n")
    for name in args.scenarios:
        mine = [r for r in rows if r["scenario"] == name]
        print(f"\n{name}: {len(mine)} runs")
        for key in ("experts", "base", "ta", "featcal"):
            lows = [min(r[key].values()) for r in mine]
            means = [r["means"][key] for r in mine]
            print(f"  {key:8s} mean {min(means):6.2f} – {max(means):6.2f}   lowest task {min(lows):6.2f}")
        gains = [r["means"]["featcal"] - r["means"]["ta"] for r in mine]
        gaps = [r["means"]["experts"] - r["means"]["ta"] for r in mine]
        ratios = [a / b for r in mine for b, a in r["drift"].values()]
        print(
            f"  FeatCal − TA (mean) {min(gains):+.2f} – {max(gains):+.2f};  experts − TA {min(gaps):.2f} – "
            f"{max(gaps):.2f}"
        )
        print(f"  last-block drift after/before: max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
