"""Per task and mean, what FeatCal settings do after a merge, over seeds: the measurements behind
"FeatCal that does no harm" (docs/tuning.md).

For each seed the scenario is built (or loaded from `--cache-dir`), each merge is made once, scored,
and every variant — a name and `FeatCalConfig` fields laid over the defaults — calibrates its own copy
of the merge; its test accuracy per task (in %), mean, and seconds are printed as one JSON line per
(seed, merge, variant), then a table per merge: per task and mean, averaged over the seeds, with the
change against the merge alone and against the default FeatCal (the variant named `default`).

    python benchmarks/no_harm.py --scenario minilm --seeds 0 1 2 --merges task_arithmetic regmean \\
        --variant default --variant 'rho1:anchor_rho=1.0' --variant 'lang2:task_weights={"language": 2}'
    python benchmarks/no_harm.py --scenario digits --seeds 0 1 2 --merges task_arithmetic ties

A variant is `name` or `name:field=value,field=value` (values as JSON, else as strings; a value
holding commas or braces must be JSON, e.g. `task_weights={"language": 2}` as the only field, or
repeat `--variant`). Calibration examples: the scenario's train-split draw (`--samples`, 64 per task by
default, as `hf-featcal compare --demo`), never the test split.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import time
import warnings
from typing import Any

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.compare import _merge, check_merges
from hf_featcal.pipeline.context import FeatCalWarning


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name:field=value,...` → (name, FeatCalConfig fields)."""
    name, _, rest = text.partition(":")
    fields: dict[str, Any] = {}
    if rest:
        items = [rest] if rest.count("=") == 1 else rest.split(",")
        for item in items:
            key, _, raw = item.partition("=")
            try:
                fields[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                fields[key.strip()] = raw
    known = {f.name for f in dataclasses.fields(FeatCalConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SystemExit(f"--variant {text!r}: unknown FeatCalConfig fields {unknown}")
    return name, fields


def build(scenario: str, seed: int, cache_dir: str | None, samples: int) -> Any:
    if scenario == "digits":
        from hf_featcal.scenarios.digits import build_digits_scenario

        return build_digits_scenario(seed=seed, cache_dir=cache_dir)
    from hf_featcal.scenarios.minilm import build_minilm_scenario

    return build_minilm_scenario(seed=seed, cache_dir=cache_dir, calibration_samples=samples)


def with_mean(scores: dict[str, float]) -> dict[str, float]:
    return {**scores, "mean": sum(scores.values()) / len(scores)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    variants = [parse_variant(v) for v in args.variant]
    merges = check_merges(args.merges)
    rows = []
    for seed in args.seeds:
        scenario = build(args.scenario, seed, args.cache_dir, args.samples)

        def percent(model: Any, scenario: Any = scenario) -> dict[str, float]:
            return with_mean({t: 100.0 * v for t, v in scenario.evaluate(model).items()})

        for method, params in merges.items():
            base_config = FeatCalConfig(num_samples_per_task=args.samples)
            merged = _merge(method, params, scenario.base, scenario.experts, scenario.calibration, base_config, None)
            merge_row = {"seed": seed, "merge": method, "variant": "merge", "scores": percent(merged), "seconds": 0.0}
            rows.append(merge_row)
            print(json.dumps(merge_row), flush=True)
            for name, fields in variants:
                config = dataclasses.replace(base_config, **fields)
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FeatCalWarning)
                    calibrator = FeatCalCalibrator(copy.deepcopy(merged), scenario.base, scenario.experts,
                                                   scenario.calibration, config, show_progress=False)
                    calibrated = calibrator.calibrate()
                seconds = time.perf_counter() - start
                row = {"seed": seed, "merge": method, "variant": name, "fields": fields,
                       "scores": percent(calibrated), "seconds": seconds}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def tables(rows: list[dict[str, Any]]) -> str:
    """Per merge: each variant's per-task and mean accuracy averaged over seeds, and its change."""
    out = []
    for merge in dict.fromkeys(r["merge"] for r in rows):
        mine = [r for r in rows if r["merge"] == merge]
        names = list(dict.fromkeys(r["variant"] for r in mine))
        keys = list(mine[0]["scores"])
        seeds = sorted({r["seed"] for r in mine})

        def average(variant: str, key: str, mine: list = mine) -> float:
            values = [r["scores"][key] for r in mine if r["variant"] == variant]
            return sum(values) / len(values)

        def seconds(variant: str, mine: list = mine) -> float:
            values = [r["seconds"] for r in mine if r["variant"] == variant]
            return sum(values) / len(values)

        out.append(f"\n{merge} (mean over seeds {seeds}; Δ against the merge alone, and against `default`)\n")
        out.append("| variant | " + " | ".join(keys) + " | s |")
        out.append("|---|" + "---:|" * (len(keys) + 1))
        for name in names:
            cells = []
            for key in keys:
                value = average(name, key)
                cell = f"{value:.1f}"
                if name != "merge":
                    cell += f" ({value - average('merge', key):+.1f}"
                    if name != "default" and "default" in names:
                        cell += f"; {value - average('default', key):+.1f}"
                    cell += ")"
                cells.append(cell)
            out.append(f"| {name} | " + " | ".join(cells) + f" | {seconds(name):.0f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["digits", "minilm"], default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--merges", nargs="+", default=["task_arithmetic", "regmean"])
    parser.add_argument("--variant", action="append", default=None,
                        help="name or name:field=value,... (repeatable; default: `default` alone)")
    parser.add_argument("--samples", type=int, default=64, help="calibration examples per task")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hf_featcal"))
    parser.add_argument("--output", help="also write every row as JSON here")
    args = parser.parse_args()
    args.variant = args.variant or ["default"]
    rows = run(args)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(rows, handle, indent=1)
    print(tables(rows))


if __name__ == "__main__":
    main()
