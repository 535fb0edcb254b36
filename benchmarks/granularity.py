"""Block vs module granularity of FeatCal on the toy scenarios (digits / seq2seq / causal).

For each scenario and seed: the Task Arithmetic merge (0.3), then FeatCal on it with
`granularity="block"` (the paper's) and `granularity="module"`, with the settings the tests use;
prints one JSON line per run (mean score over tasks, FeatCal wall seconds) and a table at the end.

    python benchmarks/granularity.py --scenarios digits text causal --seeds 0 1 2

Builds are cached in /tmp/scen_cache_<scenario>_<seed> (pass --no-cache to build from scratch).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.merging import task_arithmetic

# the text scenarios are test fixtures: they live in tests/scenarios/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

GRANULARITIES = ("block", "module")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _featcal(merged, base, experts, data, config) -> tuple[torch.nn.Module, float]:
    model = copy.deepcopy(merged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        FeatCalCalibrator(model, base, experts, data, config, show_progress=False).calibrate()
        seconds = time.perf_counter() - start
    return model, seconds


def digits(seed: int, cache_dir: str | None) -> dict:
    from hf_featcal.scenarios.digits import build_digits_scenario

    s = build_digits_scenario(seed=seed, cache_dir=cache_dir)
    merged = s.task_arithmetic(0.3)
    row = {"ta": 100 * _mean(s.evaluate(merged).values())}
    for granularity in GRANULARITIES:
        config = FeatCalConfig(num_samples_per_task=64, granularity=granularity)
        calibrated, seconds = _featcal(merged, s.base, s.experts, s.calibration, config)
        row[granularity], row[f"{granularity}_seconds"] = 100 * _mean(s.evaluate(calibrated).values()), seconds
    return row


def _text_like(s) -> dict:
    merged = task_arithmetic(s.base, s.experts, scaling_factor=0.3).eval()

    def score(model) -> float:
        return _mean(v for t, v in s.evaluate(model).items() if t != "mean")

    row = {"ta": score(merged)}
    for granularity in GRANULARITIES:
        calibrated, seconds = _featcal(merged, s.base, s.experts, s.calibration_batches,
                                       FeatCalConfig(granularity=granularity))
        row[granularity], row[f"{granularity}_seconds"] = score(calibrated), seconds
    return row


def text(seed: int, cache_dir: str | None) -> dict:
    from scenarios.text import build_text_scenario

    return _text_like(build_text_scenario(seed=seed, cache_dir=cache_dir))


def causal(seed: int, cache_dir: str | None) -> dict:
    from scenarios.causal import build_causal_scenario

    return _text_like(build_causal_scenario(seed=seed, cache_dir=cache_dir))


SCENARIOS = {"digits": digits, "text": text, "causal": causal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true", help="build every scenario from scratch")
    parser.add_argument("--output", help="also append the JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        for name in args.scenarios:
            cache = None if args.no_cache else f"/tmp/scen_cache_{name}_{seed}"
            row = {"scenario": name, "seed": seed, **SCENARIOS[name](seed, cache)}
            row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if args.output:
                with open(args.output, "a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
    print("\n| seed | scenario | TA | block | module | block s | module s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['scenario']} | {r['ta']:.2f} | {r['block']:.2f} | {r['module']:.2f} | "
              f"{r['block_seconds']:.2f} | {r['module_seconds']:.2f} |")
    for name in args.scenarios:
        mine = [r for r in rows if r["scenario"] == name]
        print(
            f"{name}: mean over seeds TA {_mean(r['ta'] for r in mine):.2f}, block "
            f"{_mean(r['block'] for r in mine):.2f}, "
            f"module {_mean(r['module'] for r in mine):.2f}; seconds block "
            f"{_mean(r['block_seconds'] for r in mine):.2f}, "
            f"module {_mean(r['module_seconds'] for r in mine):.2f}"
        )


if __name__ == "__main__":
    main()
