"""``hf-featcal calibrate``: FeatCal on a merged model (the recipe run's stages after *merge*), saved
with its model card, drift report and drift plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from ..families import family_names
from ._common import (
    FORMATTER,
    CLIError,
    ProgressBars,
    adapter_base,
    add_common,
    add_recipe_options,
    check_device,
    check_not_adapter_base,
    check_output_dir,
    check_push,
    check_source,
    family_of,
    first_processing,
    help_text,
    log,
    positive_int,
    quiet_warnings,
    recipe_values,
    task_pairs,
    task_value,
)

_CALIBRATE_EPILOG = """\
examples:
  # CLIP: images from each task's train split, processed by the base's CLIPImageProcessor
  hf-featcal calibrate --model clip-ta --base openai/clip-vit-base-patch32 \\
      --expert mnist=tanganke/clip-vit-base-patch32_mnist --expert dtd=tanganke/clip-vit-base-patch32_dtd \\
      --data mnist=ylecun/mnist --data dtd=tanganke/dtd --num-examples 256 --output-dir clip-ta-featcal
  # FLAN-T5: GLUE train examples in the experts' prompt format ("{task}" is replaced by the task)
  hf-featcal calibrate --model t5-ta --base google/flan-t5-base \\
      --expert cola=tanganke/flan-t5-base_glue-cola --expert rte=tanganke/flan-t5-base_glue-rte \\
      --data-default nyu-mll/glue --data-default-config "{task}" --output-dir t5-ta-featcal
  # a decoder LLM: chat messages rendered by the base's chat template, cut at 1024 tokens
  hf-featcal calibrate --model llama-ta --base meta-llama/Llama-3.2-1B-Instruct --expert math=./math \
      --expert code=./code --data-default "./{task}_chats" --messages-column messages --max-length 1024 \
      --output-dir llama-ta-featcal
  # local folders (Dataset.save_to_disk; a DatasetDict gives --split)
  hf-featcal calibrate --model ./merged --base ./base --expert a=./expert_a --data a=./data_a \\
      --lambda-ratio 0.1 --output-dir ./merged-featcal

The output folder holds the calibrated model, its processor / tokenizer, a model card (README.md),
featcal_drift_report.json, featcal_config.json and the drift plot featcal_drift.png.
"""


#: FeatCalConfig fields offered as calibrate options (type, default and help from the dataclass
#: field), with their metavar; `batch_size` is checked by argparse already.
_FEATCAL_OPTIONS: dict[str, str | None] = {
    "lambda_ratio": "λ", "anchor_rho": "ρ", "teacher_alpha": "α", "batch_size": None, "seed": None,
    "heldout_fraction": "SHARE", "guard": "MODE",
}
_ANNOTATION_TYPES: dict[str, Callable[[str], Any]] = {"float": float, "int": int, "str": str}
_CALIBRATION_DEST = "calibration_"
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {"batch_size": positive_int}


def register(commands: Any) -> None:
    """Add the command's subparser to `commands` (the parser's subparsers)."""
    p = commands.add_parser(
        "calibrate", help="calibrate a merged model towards its experts with FeatCal",
        description="Run FeatCal on a merged model (a folder or hub id) with a few calibration examples per "
        "task, and save the calibrated model with its model card, drift report and drift plot.",
        epilog=_CALIBRATE_EPILOG, formatter_class=FORMATTER,
    )
    p.add_argument("--model", required=True, help="the merged model: local folder or hub id")
    p.add_argument("--base", help="the base model the experts were fine-tuned from (anchor; recommended)")
    p.add_argument("--expert", dest="experts", type=task_value, action="append", required=True, metavar="TASK=SOURCE",
                   help="an expert (hub id or local folder); repeat for every task")
    p.add_argument("--data", type=task_value, action="append", default=[], metavar="TASK=DATASET",
                   help="calibration dataset of TASK: hub id or a Dataset.save_to_disk folder")
    p.add_argument("--data-config", type=task_value, action="append", default=[], metavar="TASK=NAME",
                   help="dataset config name of TASK (hub datasets)")
    calibration = p.add_argument_group(
        "calibration data (the recipe's calibration.default keys; --data-default: every task without --data)")
    add_recipe_options(calibration, "calibration.default", dest_prefix=_CALIBRATION_DEST)  # every declared key
    p.add_argument("--family", choices=family_names(), help="model family (default: from the model)")
    p.add_argument("--processor",
                   help="processor / tokenizer folder or hub id (default: the model folder, else the base)")
    _add_featcal_options(p)
    add_recipe_options(p, "", ("output_dir", "push_to_hub", "private", "overwrite"), required=("output_dir",))
    add_common(p)
    p.set_defaults(func=run)


def _add_featcal_options(parser: argparse.ArgumentParser) -> None:

    from ..config import FeatCalConfig  # dataclass only: no torch

    group = parser.add_argument_group("FeatCal settings (default: the authors' demo values)")
    group.add_argument("--featcal-config", metavar="FILE",
                       help="a featcal_config.json (or a JSON/YAML mapping of FeatCalConfig fields); the options "
                            "below override it")
    fields = {f.name: f for f in dataclasses.fields(FeatCalConfig)}
    for name, metavar in _FEATCAL_OPTIONS.items():
        field = fields[name]
        kind = _OPTION_TYPES.get(name) or _ANNOTATION_TYPES[str(field.type)]
        group.add_argument("--" + name.replace("_", "-"), type=kind, metavar=metavar,
                           help=help_text(f"{field.metadata['help']} (default {field.default!r})"))
    group.add_argument("--task-weight", "--task-weights", dest="task_weights", type=task_value, action="append",
                       default=[], metavar="TASK=WEIGHT",
                       help="weight of TASK in the joint objective (FeatCalConfig.task_weights; repeat per task; "
                            "tasks not given weigh 1): a task calibration hurts can be up-weighted, e.g. language=2")


def _featcal_config(args: argparse.Namespace) -> Any:
    from ..recipes import RecipeError, load_yaml, parse_featcal

    values: dict[str, Any] = {}
    if args.featcal_config:
        path = args.featcal_config
        if os.path.isdir(path):
            path = os.path.join(path, "featcal_config.json")
        if not os.path.isfile(path):
            raise CLIError(f"--featcal-config: {args.featcal_config!r} does not exist")
        import yaml

        with open(path, encoding="utf-8") as handle:
            try:
                loaded = load_yaml(handle)  # JSON is YAML; a key given twice is refused
            except yaml.YAMLError as err:
                raise CLIError(f"--featcal-config: {path!r} is not valid JSON/YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise CLIError(f"--featcal-config: {path!r} must hold a mapping of FeatCalConfig fields")
        values.update(loaded)
    for name in _FEATCAL_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    if args.task_weights:
        given = values.get("task_weights")  # the file's weights, each overridden by a flag of the same task
        values["task_weights"] = {**(given if isinstance(given, dict) else {}), **_task_weights(args.task_weights)}
    try:
        return parse_featcal(None, values, "featcal")
    except RecipeError as err:
        raise CLIError(f"{err} (from --featcal-config or the FeatCal options)") from None


def _task_weights(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """--task-weight TASK=WEIGHT pairs as numbers (the config checks their range)."""
    weights = {}
    for task, text in task_pairs(pairs, "--task-weight").items():
        try:
            weights[task] = float(text)
        except ValueError:
            raise CLIError(f"--task-weight {task}={text}: the weight must be a number") from None
    return weights


def run(args: argparse.Namespace) -> int:
    """The recipe run's stages on a given merged model: load it (in place of *merge*), then
    `load_calibration_data` → `build_calibrator` → `calibrate_merged` → `save_run` → `push_run`."""
    model_source = check_source(args.model, "--model")
    base_source = check_source(args.base, "--base") if args.base else None
    check_not_adapter_base(base_source)
    if adapter_base(model_source) == "" and base_source is None:  # an adapter is a model only on its base
        raise CLIError(f"--model: {args.model!r} is a LoRA adapter that records no base model: pass the model it was "
                       "trained on as --base (the adapter is then applied to it)")
    experts = {t: check_source(s, f"--expert {t}") for t, s in task_pairs(args.experts, "--expert").items()}
    data = {t: check_source(d, f"--data {t}", kind="dataset") for t, d in task_pairs(args.data, "--data").items()}
    configs = task_pairs(args.data_config, "--data-config")
    for option, mapping in (("--data", data), ("--data-config", configs)):
        for task in mapping:
            if task not in experts:
                raise CLIError(f"{option} {task}=...: no --expert named {task!r} (experts: {list(experts)})")
    default = recipe_values(args, "calibration.default", _CALIBRATION_DEST)
    missing = [t for t in experts if t not in data]
    if missing and "dataset" not in default:
        raise CLIError(f"--data: no calibration dataset for {missing}; give --data TASK=DATASET or --data-default")
    config = _featcal_config(args)
    for task in config.task_weights or {}:
        if task not in experts:
            raise CLIError(f"task weight {task!r} (--task-weight or --featcal-config): no --expert named {task!r} "
                           f"(experts: {list(experts)})")
    check_device(args.device)
    check_push(args.push_to_hub, args.private)
    check_output_dir(args.output_dir, inputs=_calibrate_inputs(args, model_source, base_source, experts, data),
                      overwrite=bool(args.overwrite), written_by=_writer(model_source, base_source))

    with ProgressBars(args.quiet):
        return _calibrate(args, model_source, base_source, experts, data, configs, default, config)


def _writer(model_source: str, base_source: str | None) -> dict[str, str]:
    """What the save records of its writer (an earlier save of another is replaced only with --overwrite)."""
    return {"command": "hf-featcal calibrate", "base": base_source or model_source}


def _calibrate_inputs(
    args: argparse.Namespace, model_source: str, base_source: str | None, experts: dict[str, str], data: dict[str, str]
) -> dict[str, Any]:
    """Flag → source of everything ``calibrate`` reads (local ones are checked against --output-dir)."""
    return {"--model": model_source, "--base": base_source, "--processor": args.processor,
            **{f"--expert {task}": source for task, source in experts.items()},
            **{f"--data {task}": source for task, source in data.items()}}


def _calibrate(
    args: argparse.Namespace,
    model_source: str,
    base_source: str | None,
    experts: dict[str, str],
    data: dict[str, str],
    configs: dict[str, str],
    default: dict[str, Any],
    config: Any,
) -> int:

    from ..model_io import load_model
    from ..pipeline.checks import check_forward_dtype
    from ..recipes import (
        RecipeError,
        build_calibrator,
        calibrate_merged,
        load_calibration_data,
        parse_calibration,
        push_run,
        save_run,
    )
    from ..schema import recipe_keys

    log(f"Loading the merged model {args.model} ...")
    model = load_model(model_source, "--model", base=base_source)  # an adapter --model: applied to --base
    family = family_of(model, args.family)
    try:  # before the calibration data are loaded
        check_forward_dtype(config, {"--model": model})
    except ValueError as err:
        raise CLIError(f"{err} (forward_dtype from --featcal-config)") from None
    tasks_section = {t: {"dataset": d, **({"config": configs[t]} if t in configs else {})} for t, d in data.items()}
    try:
        specs = parse_calibration(None, {"default": default, "tasks": tasks_section}, family.name, list(experts),
                                  recipe_keys("calibration.default")["num_examples"].default)
    except RecipeError as err:
        flags = {f"calibration.default.{name}": key.flag for name, key in recipe_keys("calibration.default").items()}
        given = f" (given by {flags[err.key]})" if err.key in flags else ""
        raise CLIError(f"calibration data: {err}{given}") from None

    processing = first_processing(family, [args.processor, model_source, base_source])
    calibration = load_calibration_data(family.name, specs, processing, config.seed, log=log)
    config = dataclasses.replace(config, num_samples_per_task=None)
    finish = quiet_warnings()
    try:
        calibrator = build_calibrator(model, base_source, experts, calibration, config, family, processing,
                                      device=args.device, show_progress=not args.quiet)
        run = calibrate_merged(calibrator, model, family, processing, log=log)
    finally:
        ridge = finish()
    plot, _ = save_run(run, args.output_dir, family, processing, overwrite=bool(args.overwrite),
                       inputs=_calibrate_inputs(args, model_source, base_source, experts, data),
                       written_by=_writer(model_source, base_source))
    if run.calibrator.report is not None:
        print("Feature drift per task (before → after FeatCal)\n")
        print(run.calibrator.report.summary_markdown())
    if ridge:
        print(f"\n{ridge} module groups had input directions without data (their solution there is set by the ridge).")
    print(f"\nCalibrated in {run.timings['calibrate']:.1f} s; saved model, model card and drift report to "
          f"{args.output_dir}"
          + (f" (plot: {plot})" if plot else ""))
    pushed = push_run(args.output_dir, args.push_to_hub, private=args.private, log=log)
    if pushed:
        print(f"Pushed to https://huggingface.co/{pushed}")
    return 0
