"""Running a recipe: the stages `run_recipe` chains (and ``hf-featcal merge`` / ``calibrate`` /
``compare`` reuse), the model card's evaluation section and the upload."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import FeatCalConfig
from ..families import ModelFamily
from .load import check_family, evaluate_model, prepare_calibration
from .parse import Recipe
from .preflight import (
    check_fast_mode,
    check_output_dir,
    check_recipe_inputs,
    check_recipe_targets,
    recipe_input_folders,
    recipe_writer,
)
from .spec import DatasetSpec, EvaluationSpec, MergeSpec, RecipeError

__all__ = [
    "CalibrationRun",
    "RecipeInputs",
    "RecipeResult",
    "StepRun",
    "build_calibrator",
    "calibrate_merged",
    "check_fast_mode",
    "check_output_dir",
    "lm_eval_table",
    "load_calibration_data",
    "merge_experts",
    "post_merge",
    "prepare_recipe_inputs",
    "push_run",
    "recipe_evaluator",
    "recipe_input_folders",
    "run_recipe",
    "save_calibrated",
    "save_run",
    "save_step_run",
    "upload_folder",
]


@dataclass
class RecipeInputs:
    """What a recipe run loads before merging: the base model, its processing classes, the text
    tower of zero-shot heads (CLIP; None when not evaluating or not needed) and task → prepared
    calibration ``Dataset``."""

    base: Any
    processing: dict[str, Any]
    clip_model: Any
    calibration: dict[str, Any]


def prepare_recipe_inputs(recipe: Recipe, *, evaluate: bool = True, log: Callable[[str], None] = print) -> RecipeInputs:
    """Load a recipe's base, processing classes, zero-shot text tower (when `evaluate` and the recipe
    evaluates) and calibration data — the steps `run_recipe` (and `hf-featcal compare RECIPE`) take
    before merging."""
    from ..model_io import load_model

    family = recipe.model_family
    log(f"Loading the base model {recipe.base} ...")
    base = load_model(recipe.base, "base")
    check_family(base, family, "base")
    model_family = recipe.family
    try:
        processing = model_family.load_processing(recipe.base)
    except (OSError, ValueError, TypeError) as err:  # transformers' error would speak of the hub
        raise RecipeError(
            "base", f"{recipe.base!r} has no {model_family.processing_name} to process the calibration data with: "
            "save the base's processor with it (processor.save_pretrained(<base folder>)) or set base to a model "
            "that has one (--debug shows transformers' error)", recipe.source,
        ) from err
    clip_model = None
    if recipe.evaluation is not None and evaluate:  # the text tower of zero-shot heads, before merging
        clip_model, processing = model_family.recipe_text_model(base, recipe.evaluation, processing, load_model)

    calibration = load_calibration_data(family, recipe.calibration, processing, recipe.featcal.seed, log=log)
    return RecipeInputs(base=base, processing=processing, clip_model=clip_model, calibration=calibration)


def load_calibration_data(
    family: str,
    specs: Mapping[str, DatasetSpec],
    processing: Mapping[str, Any] | None,
    seed: int,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Stage *load*: task → calibration ``Dataset`` prepared for the family (`prepare_calibration`)."""
    log("Loading the calibration data ...")
    return {task: prepare_calibration(family, task, spec, processing, seed) for task, spec in specs.items()}


def recipe_evaluator(
    recipe: Recipe, inputs: RecipeInputs, device: Any = None
) -> Callable[..., tuple[dict[str, float], dict[str, Any]]]:
    """``evaluate(model, tasks=None)`` → (task → headline score in [0, 1], details): the recipe's
    evaluation (`evaluate_model`) on every evaluated task, or on `tasks` only."""
    if recipe.evaluation is None:
        raise RecipeError("evaluation", "is false; this needs the recipe's evaluation", recipe.source)
    spec = recipe.evaluation

    def evaluate(model: Any, tasks: list[str] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        chosen = spec if tasks is None else dataclasses.replace(spec, tasks=list(tasks))
        return evaluate_model(recipe.model_family, model, chosen, processing=inputs.processing,
                              clip_model=inputs.clip_model, device=device)

    return evaluate


@dataclass
class RecipeResult:
    """What `run_recipe` produced."""

    output_dir: str
    report: Any
    before: dict[str, float] | None
    after: dict[str, float] | None
    plot_path: str | None
    timings: dict[str, float]
    table: str | None
    pushed_to: str | None = None


# The stages of a run. `run_recipe` is their sequence; ``hf-featcal merge`` / ``calibrate`` build the
# same inputs from their flags and call the same stages (a given merged model replaces *merge*):
#   check_output_dir → prepare_recipe_inputs / load_calibration_data → merge_experts →
#   build_calibrator → calibrate_merged (evaluating before and after when asked) → save_run → push_run


def merge_experts(base: Any, experts: Mapping[str, Any], merge: MergeSpec, *,
                  log: Callable[[str], None] = print) -> Any:
    """Stage *merge*: ``merge_models(base, experts, method, **params)`` of a validated `MergeSpec`."""
    from ..merging import merge_models

    log(f"Merging {len(experts)} experts: {merge.describe()} ...")
    return merge_models(base, dict(experts), merge.method, **merge.params)


@dataclass(kw_only=True)
class ScoredRun:
    """The scores of a run's model before / after its post-merging step (None when not evaluated),
    their details and the seconds per stage."""

    before: dict[str, float] | None
    after: dict[str, float] | None
    details: dict[str, Any]
    timings: dict[str, float]


@dataclass(kw_only=True)
class CalibrationRun(ScoredRun):
    """What `calibrate_merged` produced: the calibrator (its report, its ``save_model``) and the
    calibrated model, with the scores (`ScoredRun`)."""

    calibrator: Any
    calibrated: Any


def calibrate_merged(
    calibrator: Any,
    merged: Any,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    evaluation: EvaluationSpec | None = None,
    clip_model: Any = None,
    log: Callable[[str], None] = print,
) -> CalibrationRun:
    """Stage *calibrate*: ``calibrator.calibrate()`` (a `build_calibrator` of `merged`, which checks the
    inputs first), with `evaluation` (if given) of the merged model before and of the calibrated model
    after, on the calibrator's device."""
    run_device = str(calibrator.device)
    timings: dict[str, float] = {}
    details: dict[str, Any] = {}

    def evaluate(model: Any, when: str, what: str) -> dict[str, float]:
        assert evaluation is not None
        clock = time.perf_counter()
        log(f"Evaluating the {what} model ...")
        scores, details[when] = evaluate_model(model_family.name, model, evaluation, processing=processing or {},
                                               clip_model=clip_model, device=run_device)
        timings[f"evaluate_{when}"] = time.perf_counter() - clock
        return scores

    before = evaluate(merged, "before", "merged") if evaluation is not None else None
    clock = time.perf_counter()
    log(f"Calibrating with FeatCal on {run_device} ...")
    calibrated = calibrator.calibrate()
    timings["calibrate"] = time.perf_counter() - clock
    after = evaluate(calibrated, "after", "calibrated") if evaluation is not None else None
    return CalibrationRun(calibrator=calibrator, calibrated=calibrated, before=before, after=after,
                          details=details, timings=timings)


def save_run(
    run: CalibrationRun,
    output_dir: str,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    recipe: Recipe | None = None,
    overwrite: bool = False,
    inputs: Mapping[str, Any] | None = None,
    written_by: Mapping[str, str] | None = None,
) -> tuple[str | None, str | None]:
    """Stage *save*: one save (`hf_featcal.saving.atomic_folder`, one manifest) of the calibrated folder
    (`save_calibrated`'s files) and, with the run's `recipe`, the before / after table
    (``featcal_evaluation.json``, the model card's evaluation section) and the resolved recipe
    (``featcal_recipe.yaml``). `output_dir` is checked as the *check* stage does (`inputs`: the run's
    sources besides the calibrator's own; `overwrite`; `written_by`, recorded in the manifest: an
    earlier save of another writer is replaced only with `overwrite`). Returns (drift plot path, scores
    table)."""
    from ..saving import atomic_folder

    table = None if recipe is None else _scores_table(recipe, run.before, run.after, run.details, "FeatCal")
    if not run.calibrator.state.is_main_process:
        return None, table
    with atomic_folder(output_dir, inputs={**run.calibrator.input_folders(), **(inputs or {})},
                       overwrite=overwrite, written_by=written_by) as folder:
        plot_name = _write_calibrated(run.calibrator, folder, model_family, processing)
        if recipe is not None:
            _write_records(folder, recipe, table, run.before, run.after, run.details, "FeatCal", plot=plot_name)
    return (None if plot_name is None else os.path.join(output_dir, plot_name)), table


def _scores_table(recipe: Recipe, before: dict[str, float] | None, after: dict[str, float] | None,
                  details: Mapping[str, Any], step: str) -> str | None:
    """The before / after table of a run (rows: the merge, the merge + `step`), with the
    lm-evaluation-harness scores in `details` where there are any; None when not evaluated."""
    from ..evaluation.results import scores_table

    if recipe.evaluation is None or before is None or after is None:
        return None
    rows = {recipe.merge.describe(): "before", f"{recipe.merge.describe()} + {step}": "after"}
    table = scores_table({row: before if key == "before" else after for row, key in rows.items()},
                         recipe.evaluation.tasks, percent=recipe.family.score_in_percent)
    harness = lm_eval_table(details, rows)
    return table if not harness else table + "\n\nlm-evaluation-harness (zero-shot)\n\n" + harness


def _write_records(folder: str, recipe: Recipe, table: str | None, before: dict[str, float] | None,
                   after: dict[str, float] | None, details: Mapping[str, Any], step: str,
                   plot: str | None = None) -> None:
    """Into a save being made: the evaluation (``featcal_evaluation.json`` and the card's section, where
    `table` is given; the card shows the drift plot `plot` where one was written) and the resolved recipe
    (``featcal_recipe.yaml``)."""
    import yaml

    if table is not None:
        with open(os.path.join(folder, "featcal_evaluation.json"), "w", encoding="utf-8") as handle:
            json.dump({"before": before, "after": after, "details": details}, handle, indent=2, default=str)
            handle.write("\n")
        _append_to_card(folder, table, recipe, step, plot)
    with open(os.path.join(folder, "featcal_recipe.yaml"), "w", encoding="utf-8") as handle:
        handle.write(f"# The recipe of this run (from {recipe.source or 'a dict'}), resolved: hf-featcal run "
                     "<this file>\n")
        yaml.safe_dump(recipe.to_dict(), handle, sort_keys=False, allow_unicode=True)


def push_run(
    output_dir: str, repo_id: str | None, *, private: bool | None = None, log: Callable[[str], None] = print
) -> str | None:
    """Stage *push*: upload exactly the files of the save in `output_dir` (its manifest's, local paths
    redacted: `upload_folder`) to `repo_id`, created `private` when asked; returns the repo id, None
    when `repo_id` is None."""
    if not repo_id:
        return None
    log(f"Uploading the saved files of {output_dir} to {repo_id} ...")
    upload_folder(output_dir, repo_id, private=private)
    return repo_id


def build_calibrator(
    merged: Any,
    base: Any,
    experts: Mapping[str, Any],
    calibration: Mapping[str, Any],
    config: FeatCalConfig,
    model_family: ModelFamily,
    processing: Mapping[str, Any],
    *,
    device: Any = None,
    show_progress: bool = True,
) -> Any:
    """Stage *build*: the `FeatCalCalibrator` of a run (checks its inputs before anything is computed),
    with the family's processing class for the calibration data; `calibrate_merged` runs it."""
    from ..calibrator import FeatCalCalibrator

    return FeatCalCalibrator(
        merged, base, dict(experts), calibration, config,
        processing_class=model_family.calibration_processing_class(processing),
        device=device, show_progress=show_progress,
    )


def save_calibrated(
    calibrator: Any,
    output_dir: str,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    overwrite: bool = False,
) -> str | None:
    """Save a calibrated run's folder (model, processing classes, card, drift report, config, drift
    plot) as one save (`hf_featcal.saving.atomic_folder`); returns the plot's path (None without a
    drift report)."""
    from ..saving import atomic_folder

    if not calibrator.state.is_main_process:
        return None
    with atomic_folder(output_dir, inputs=calibrator.input_folders(), overwrite=overwrite) as folder:
        plot_name = _write_calibrated(calibrator, folder, model_family, processing)
    return None if plot_name is None else os.path.join(output_dir, plot_name)


def _write_calibrated(calibrator: Any, folder: str, model_family: ModelFamily,
                      processing: Mapping[str, Any] | None) -> str | None:
    """`calibrator.write_model_folder` and the drift plot into `folder`; returns the plot's file name."""
    from ..plotting import plot_drift

    calibrator.write_model_folder(folder, processing_class=model_family.processing_to_save(processing))
    if calibrator.report is None:
        return None
    plot_drift(calibrator.report, os.path.join(folder, "featcal_drift.png"))
    return "featcal_drift.png"


def run_recipe(
    recipe: Recipe,
    *,
    device: str | None = None,
    evaluate: bool = True,
    push_to_hub: bool = True,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
) -> RecipeResult:
    """Execute a recipe: merge → calibrate (checks first) → evaluate before/after → save (+ push), the
    stages `check_output_dir` → `prepare_recipe_inputs` → `merge_experts` → `build_calibrator` →
    `calibrate_merged` → `save_run` → `push_run`. A recipe whose ``post_merging`` is another step runs
    `post_merge` and `save_step_run` in place of the calibration's stages (in one process).

    The output folder gets the calibrated model (``save_pretrained``; open_clip: its own format), its
    processor / tokenizer,
    the model card (``README.md``, with the evaluation appended), ``featcal_drift_report.json``,
    ``featcal_config.json``, ``featcal_drift.png``, ``featcal_evaluation.json`` and the recipe
    (``featcal_recipe.yaml``).
    """
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    inputs_read = recipe_input_folders(recipe)
    featcal = recipe.post_merging == "featcal"
    if not featcal:
        check_one_process(recipe)
    # the pre-flight: output folder and push before anything is loaded; module selection, batches and
    # class names against the base and the data before anything is merged
    check_recipe_targets(recipe, push=push_to_hub)
    inputs = prepare_recipe_inputs(recipe, evaluate=evaluate, log=log)
    check_recipe_inputs(recipe, inputs, featcal=featcal, evaluate=evaluate, device=device)
    timings["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    merged = merge_experts(inputs.base, recipe.experts, recipe.merge, log=log)
    timings["merge"] = time.perf_counter() - clock
    if not featcal:
        step_run = post_merge(recipe, inputs, merged, device=device, evaluate=evaluate, log=log)
        timings.update(step_run.timings)
        table = save_step_run(step_run, recipe, inputs, inputs_read)
        pushed = push_run(recipe.output_dir, recipe.push_to_hub if push_to_hub else None, private=recipe.private,
                          log=log)
        return RecipeResult(output_dir=recipe.output_dir, report=step_run.result.report, before=step_run.before,
                            after=step_run.after, plot_path=None, timings=timings, table=table, pushed_to=pushed)

    calibrator = build_calibrator(merged, inputs.base, recipe.experts, inputs.calibration, recipe.featcal,
                                  recipe.family,
                                  inputs.processing, device=device, show_progress=show_progress)
    run = calibrate_merged(calibrator, merged, recipe.family, inputs.processing,
                           evaluation=recipe.evaluation if evaluate else None, clip_model=inputs.clip_model, log=log)
    timings.update(run.timings)
    plot_path, table = save_run(run, recipe.output_dir, recipe.family, inputs.processing, recipe=recipe,
                                overwrite=recipe.overwrite, inputs=inputs_read, written_by=recipe_writer(recipe))
    pushed = push_run(recipe.output_dir, recipe.push_to_hub if push_to_hub else None, private=recipe.private, log=log)
    return RecipeResult(
        output_dir=recipe.output_dir,
        report=run.calibrator.report,
        before=run.before,
        after=run.after,
        plot_path=plot_path,
        timings=timings,
        table=table,
        pushed_to=pushed,
    )


def check_one_process(recipe: Recipe) -> None:
    """A post-merging step other than FeatCal runs in one process: a RecipeError naming ``post_merging``
    under a launcher that started several (each would run the whole step and write the same folder)."""
    from ..calibrator import default_process_state

    processes = default_process_state().num_processes
    if processes > 1:
        raise RecipeError("post_merging", f"{recipe.post_merging!r} runs in one process, this run has {processes}: "
                          "start it without accelerate launch (FeatCal alone spreads over processes)", recipe.source)


@dataclass(kw_only=True)
class StepRun(ScoredRun):
    """What `post_merge` produced: the step's name and `PostMergingResult`, with the scores (`ScoredRun`)."""

    step: str
    result: Any


def post_merge(recipe: Recipe, inputs: RecipeInputs, merged: Any, *, device: Any = None, evaluate: bool = True,
               log: Callable[[str], None] = print) -> StepRun:
    """Stage *post-merge* of a recipe whose ``post_merging`` is not FeatCal: the step (its parameters laid
    over its declared defaults) on `merged`, with the experts in memory (an adapter on the recipe's base,
    as the merge reads it) and the recipe's calibration data, evaluated before and after when asked. A
    result with per-task modules is scored task by task, each inside ``task_modules.for_task``."""
    from ..model_io import load_model
    from ..post_merging import get_step

    step = get_step(recipe.post_merging)
    family = recipe.family
    evaluation = recipe.evaluation if evaluate else None
    timings: dict[str, float] = {}
    details: dict[str, Any] = {}

    def scores(model: Any, when: str, what: str, modules: Any = None) -> dict[str, float]:
        assert evaluation is not None
        clock = time.perf_counter()
        log(f"Evaluating the {what} model ...")
        if modules is None:
            out, details[when] = evaluate_model(family.name, model, evaluation, processing=inputs.processing,
                                                clip_model=inputs.clip_model, device=device)
        else:  # each task with its own module applied
            out, details[when] = {}, {}
            for task in evaluation.tasks:
                with modules.for_task(model, task):
                    task_scores, details[when][task] = evaluate_model(
                        family.name, model, dataclasses.replace(evaluation, tasks=[task]),
                        processing=inputs.processing, clip_model=inputs.clip_model, device=device)
                out[task] = task_scores[task]
        timings[f"evaluate_{when}"] = time.perf_counter() - clock
        return out

    before = scores(merged, "before", "merged") if evaluation is not None else None
    experts = {t: load_model(source, f"experts.{t}", base=inputs.base) for t, source in recipe.experts.items()}
    clock = time.perf_counter()
    log(f"Running the post-merging step {step.name} ...")
    result = step.run(merged, inputs.base, experts, inputs.calibration, config=recipe.featcal,
                      processing_class=family.calibration_processing_class(inputs.processing), device=device,
                      **recipe.post_merging_parameters)
    timings[step.name] = time.perf_counter() - clock
    after = None
    if evaluation is not None and result.model is merged and result.task_modules is None:
        after, details["after"] = dict(before or {}), details["before"]  # the merge itself ("none"): scored above
    elif evaluation is not None:
        after = scores(result.model, "after", step.name, result.task_modules)
    return StepRun(step=step.name, result=result, before=before, after=after, details=details, timings=timings)


def save_step_run(run: StepRun, recipe: Recipe, inputs: RecipeInputs, inputs_read: Mapping[str, Any]) -> str | None:
    """Stage *save* of a `post_merge` run: one save of the step's result (`write_post_merged`: the model,
    its processing classes and, where the step has them, its per-task modules with their card), the
    before / after table (``featcal_evaluation.json``, the card's evaluation section) and the resolved
    recipe. Returns the scores table."""
    from ..post_merging.save import write_post_merged
    from ..saving import atomic_folder

    merge = recipe.merge.describe()
    table = _scores_table(recipe, run.before, run.after, run.details, run.step)
    with atomic_folder(recipe.output_dir, inputs=inputs_read, overwrite=recipe.overwrite,
                       written_by=recipe_writer(recipe)) as folder:
        write_post_merged(run.result, folder, step=run.step,
                          processing_class=recipe.family.processing_to_save(inputs.processing))
        card = os.path.join(folder, "README.md")
        if not os.path.exists(card):  # a one-model result: the card says what made it
            from ..post_merging import get_step

            with open(card, "w", encoding="utf-8") as handle:
                handle.write(f"# {merge} + {run.step}\n\nThe experts {', '.join(recipe.tasks)} merged ({merge}) "
                             f"and the merge post-processed by {run.step} ({get_step(run.step).reference}), saved "
                             "by `hf_featcal` from a recipe (`featcal_recipe.yaml`).\n")
        _write_records(folder, recipe, table, run.before, run.after, run.details, run.step)
    return table


def _append_to_card(output_dir: str, table: str, recipe: Recipe, step: str, plot: str | None) -> None:
    path = os.path.join(output_dir, "README.md")
    assert recipe.evaluation is not None
    splits = sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks})
    limit = (f", seeded random subsets of at most {recipe.evaluation.max_samples} examples per task"
             if recipe.evaluation.max_samples else "")
    heading = recipe.family.score_heading("Headline score per task")
    text = (
        f"\n## Evaluation\n\n{heading}, split {', '.join(splits)}{limit}, "
        f"before and after {step}:\n\n{table}\n"
        + (f"\n![feature drift per block]({plot})\n" if plot is not None else "")
    )
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def lm_eval_table(details: Mapping[str, Any], rows: Mapping[str, str]) -> str | None:
    """A markdown table of the lm-evaluation-harness scores in evaluation `details` (`rows`: row name →
    the key of its details, e.g. ``"before"``), one column per task and metric; None when there are none."""
    found = {name: details.get(key, {}).get("lm_eval") for name, key in rows.items()}
    found = {name: scores for name, scores in found.items() if scores}
    if not found:
        return None
    columns = sorted({(task, metric) for scores in found.values() for task, metrics in scores.items()
                      for metric in metrics})
    lines = ["| model | " + " | ".join(f"{task} {metric}" for task, metric in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, scores in found.items():
        cells = [f"{scores[task][metric]:.4f}" if metric in scores.get(task, {}) else "–" for task, metric in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def upload_folder(folder: str, repo_id: str, *, private: bool | None = None) -> Any:
    """Create (if needed) the hub model repo `repo_id` and upload exactly the files of the save in
    `folder` in one commit (`hf_featcal.saving.push_folder`: its manifest's files, local paths redacted;
    nothing else of the folder)."""
    from ..saving import push_folder

    return push_folder(folder, repo_id, private=private)
