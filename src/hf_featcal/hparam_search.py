"""Choose FeatCal's λ (`lambda_ratio`), ρ (`anchor_rho`) and α (`teacher_alpha`) on held-out
data the experts never saw.

FeatCal has three knobs that matter: the ridge strength λ towards the anchor, the anchor
extrapolation ρ (anchor = base + ρ·(merged − base)) and the teacher mix α. The defaults (the
authors' demo values λ=0.05, ρ=2.2, α=0.25) are good starting points; when a few labelled training
examples per task are available, `tune_featcal` picks the best values on a grid:

for every grid point it deep-copies the merged model, calibrates the copy with that config and
scores it with your `validation_fn(model) -> float` (higher is better, e.g. the mean accuracy over
tasks). The merged model itself is never modified.

Score `validation_fn` on examples the experts never saw, disjoint from the calibration examples —
never on the test split you report (that would make the reported numbers optimistic). Experts
fine-tuned on a whole train split have memorised it (often 95–100% accuracy there): a slice of that
split rewards settings that copy the experts and hides a task the joint calibration hurts. Hold out
part of each task's **validation** split instead (calibration examples may still come from the train
split: FeatCal reads only their inputs), or, when you fine-tune the experts yourself, keep a slice of
train out of their training. `train_holdout_split` cuts a `datasets.Dataset` into two
disjoint parts:

    from hf_featcal.hparam_search import train_holdout_split, tune_featcal

    calibration = {task: train.select(range(256)) for task, train in train_splits.items()}
    held_out = {}
    for task, validation in validation_splits.items():   # the experts never trained on these
        held_out[task], _report_part = train_holdout_split(validation, num_validation=0.5, seed=0)

    def validation_fn(model):
        return mean_accuracy(model, held_out)        # your scoring, on held_out only

    result = tune_featcal(merged, base, experts, calibration, validation_fn,
                          grid={"lambda_ratio": [0.02, 0.05, 0.1], "anchor_rho": [1.0, 2.2]})
    print(result.to_markdown())
    calibrated = result.best_model                   # or calibrate again with result.best_config

Calibration is deterministic for a fixed config (`seed` fixes the order of `Dataset` inputs),
so calibrating again with `result.best_config` reproduces `result.best_score`.

When every task matters, let `validation_fn` return one score per task (a mapping task → score) and
pick with `criterion="no_harm"`: each setting is ranked by its worst change against the merged model
as given, min over tasks of (score − merged score), and "no calibration" (the merged model itself) is
a candidate too, which wins when every calibrated setting lowers some task (docs/tuning.md).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from torch import nn

from .architectures import get_layer_map, model_config
from .calibrator import FeatCalCalibrator
from .config import FeatCalConfig
from .data import prepare_batches, text_length_limit
from .experts import make_source

__all__ = ["CRITERIA", "DEFAULT_GRID", "TuningResult", "no_harm_score", "train_holdout_split", "tune_featcal"]

#: How `tune_featcal` ranks settings: "score" (`validation_fn` returns one number), "mean" (it returns
#: task → score; their mean) and "no_harm" (task → score; the worst change against the merged model's
#: own scores, `no_harm_score`, with "no calibration" a candidate).
CRITERIA = ("score", "mean", "no_harm")
#: the keys of a `TuningResult.table` row that are not grid values
_ROW_KEYS = ("score", "seconds", "task_scores")

#: The default search grid (12 points) around the authors' demo values.
DEFAULT_GRID: dict[str, list[float]] = {
    "lambda_ratio": [0.02, 0.05, 0.1],
    "anchor_rho": [1.0, 2.2],
    "teacher_alpha": [0.25, 0.5],
}


@dataclass
class TuningResult:
    """The outcome of `tune_featcal`.

    Attributes:
        best_config: the `FeatCalConfig` of the best grid point (the base config with its values);
            None when "no calibration" won (criterion "no_harm"): use the merged model as it is.
        best_params: the grid values of the best point, e.g. `{"lambda_ratio": 0.05, ...}` (`{}`
            for "no calibration").
        best_score: its value of the criterion (criterion "score": the validation score).
        table: one row per candidate, in grid order: the grid values plus `"score"` (the criterion's
            value) and `"seconds"` (calibration + validation time); with per-task scores also
            `"task_scores"` (task → score). Criterion "no_harm" puts the "no calibration" row first
            (no grid values, score 0: the merged model's own scores).
        best_model: the calibrated copy of the best point (None with `keep_best_model=False`); the
            merged model itself when "no calibration" won.
        greater_is_better: whether higher values of `best_score` won (always True for "no_harm",
            whose changes are counted as gains).
    """

    best_config: FeatCalConfig | None
    best_params: dict[str, Any]
    best_score: float
    table: list[dict[str, Any]]
    best_model: nn.Module | None = field(default=None, repr=False)
    greater_is_better: bool = True

    def to_markdown(self, digits: int = 4) -> str:
        """The table as markdown; the best row is marked with `*`."""
        if not self.table:
            return "No grid point was evaluated."
        names = list(dict.fromkeys(k for row in self.table for k in row if k not in _ROW_KEYS))
        tasks = list(dict.fromkeys(t for row in self.table for t in row.get("task_scores", {})))
        header = [*names, *tasks, "score", "seconds", "best"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        for row in self.table:
            params = {k: v for k, v in row.items() if k not in _ROW_KEYS}
            best = "*" if params == self.best_params else ""
            cells = [str(row[k]) if k in row else "" for k in names] if params else \
                ["no calibration"] + [""] * (len(names) - 1)
            scores = row.get("task_scores", {})
            cells += [f"{scores[t]:.{digits}g}" if t in scores else "" for t in tasks]
            cells += [f"{row['score']:.{digits}g}", f"{row['seconds']:.1f}", best]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _grid_points(grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Grid points: the Cartesian product of a mapping field → values, or an explicit list of points."""
    fields = {f.name for f in dataclasses.fields(FeatCalConfig)}
    if isinstance(grid, Mapping):
        if not grid:
            raise ValueError("`grid` is empty: give at least one FeatCalConfig field with values.")
        for name, values in grid.items():
            if name not in fields:
                raise ValueError(f"`grid` key {name!r} is not a FeatCalConfig field; valid: {sorted(fields)}.")
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
                raise ValueError(f"`grid[{name!r}]` must be a non-empty list of values, got {values!r}.")
        names = list(grid)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid[n] for n in names))]
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Sequence) or len(grid) == 0:
        raise ValueError("`grid` must be a mapping field -> list of values, or a non-empty list of dicts.")
    points = []
    for index, point in enumerate(grid):
        if not isinstance(point, Mapping) or not point:
            raise ValueError(f"`grid[{index}]` must be a non-empty dict of FeatCalConfig fields, got {point!r}.")
        unknown = sorted(set(point) - fields)
        if unknown:
            raise ValueError(f"`grid[{index}]` has keys {unknown} that are not FeatCalConfig fields.")
        points.append(dict(point))
    return points


def tune_featcal(
    merged_model: nn.Module,
    base_model: Any,
    experts: Mapping[str, Any],
    calibration_data: Mapping[str, Any],
    validation_fn: Callable[[nn.Module], Any],
    grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]] | None = None,
    *,
    base_config: FeatCalConfig | None = None,
    greater_is_better: bool = True,
    criterion: str = "score",
    keep_best_model: bool = True,
    calibrator_kwargs: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> TuningResult:
    """Grid-search FeatCal settings (λ, ρ, α by default) with a validation score on held-out data.

    For every grid point: deep-copy `merged_model`, calibrate the copy with
    `dataclasses.replace(base_config, **point)`, score it with `validation_fn(copy)`. The best
    point (first one on ties) is returned with the table of all scores. The experts, the base and the
    calibration batches are prepared once for the whole grid (batches once per distinct
    `num_samples_per_task` / `batch_size` / `seed`), not once per point.

    Args:
        merged_model: the merged model (never modified).
        base_model: the base model (model, local path or hub id) or None — as for `FeatCalCalibrator`.
        experts: task → expert (model, local path or hub id).
        calibration_data: task → calibration data (`Dataset` or batches), as for `FeatCalCalibrator`.
            Must not overlap the examples `validation_fn` scores on.
        validation_fn: `model -> float` (criterion "score"), e.g. mean accuracy over tasks, or
            `model -> {task: float}` (criteria "mean" and "no_harm"), on held-out data the experts
            never trained on (never the test split). Higher is better unless `greater_is_better=False`.
            A NaN score ranks last.
        grid: a mapping FeatCalConfig field → list of values (Cartesian product, e.g.
            `{"lambda_ratio": [0.02, 0.05], "anchor_rho": [1.0, 2.2]}`) or an explicit list of
            points (dicts). Default: `DEFAULT_GRID` (12 points over λ, ρ, α).
        base_config: the settings every point starts from (default `FeatCalConfig()`).
        greater_is_better: maximise (True) or minimise (False) the scores `validation_fn` returns.
        criterion: how settings are ranked (`CRITERIA`): "score" (the number `validation_fn`
            returns), "mean" (the mean of its per-task scores) or "no_harm": `validation_fn` scores
            the merged model as given once, each setting is ranked by `no_harm_score` (its worst
            change over the tasks; ties by the mean change), and "no calibration" is a candidate
            (the table's first row, value 0), which wins unless a setting lowers no task.
        keep_best_model: keep the calibrated copy of the best point as `result.best_model`
            (memory: at most two extra copies of the model exist at a time).
        calibrator_kwargs: further `FeatCalCalibrator` arguments (`processing_class`,
            `data_collator`, `device`, ...). `show_progress` defaults to False.
        log: called with one line per grid point (e.g. `print`).

    Returns:
        A `TuningResult`.

    Raises:
        ValueError: on an invalid grid (unknown field, invalid value — named with its point), an
            unknown `criterion`, or a `validation_fn` that does not return what the criterion reads.
    """
    if not callable(validation_fn):
        raise TypeError(f"`validation_fn` must be callable (model -> float), got {type(validation_fn).__name__}.")
    if criterion not in CRITERIA:
        raise ValueError(f"`criterion` must be one of {list(CRITERIA)}, got {criterion!r}.")
    if base_config is None:
        base_config = FeatCalConfig()
    if not isinstance(base_config, FeatCalConfig):
        raise TypeError(f"`base_config` must be a FeatCalConfig, got {type(base_config).__name__}.")
    points = _grid_points(DEFAULT_GRID if grid is None else grid)
    configs = []
    for index, point in enumerate(points):  # validate every point before calibrating any
        try:
            configs.append(dataclasses.replace(base_config, **point))
        except (ValueError, TypeError) as err:
            raise ValueError(f"grid point {index} {point}: {err}") from None
    kwargs = {"show_progress": False, **dict(calibrator_kwargs or {})}
    # Prepared once for the whole grid: the model sources (folders and hub ids resolved, LoRA adapters
    # opened, bin-only checkpoints loaded) and the batches (one set per distinct sampling setting).
    layer_map = get_layer_map(merged_model, "merged_model")
    base_source = None if base_model is None else make_source(base_model, "base_model", layer_map)
    expert_sources = {task: make_source(expert, f"experts[{task!r}]", layer_map, base_source)
                      for task, expert in experts.items()}
    main_input_name, merged_config = layer_map.main_input_name, layer_map.tower_config(model_config(merged_model))
    prepared: dict[tuple[Any, ...], dict[str, Any]] = {}

    def batches_for(config: FeatCalConfig) -> Mapping[str, Any]:
        key = (config.num_samples_per_task, config.batch_size, config.seed, config.max_length)
        if key not in prepared:
            processing_class = kwargs.get("processing_class")
            max_length = text_length_limit(config.max_length, merged_config, processing_class)
            prepared[key] = {
                task: prepare_batches(task, data, main_input_name=main_input_name,
                                      num_samples=config.num_samples_per_task,
                                      batch_size=config.batch_size, seed=config.seed,
                                      data_collator=kwargs.get("data_collator"), processing_class=processing_class,
                                      max_length=max_length)
                if task in expert_sources else data
                for task, data in calibration_data.items()
            }
        return prepared[key]

    table: list[dict[str, Any]] = []
    best_index: int | None = None  # into `table`
    best_key: tuple[float, ...] = (math.nan,)
    best_model: nn.Module | None = None
    reference: dict[str, float] | None = None  # the merged model's own scores ("no_harm")
    if criterion == "no_harm":
        start = time.perf_counter()
        reference = _task_scores(validation_fn(merged_model), None, criterion)
        table.append({"score": 0.0, "seconds": time.perf_counter() - start, "task_scores": reference})
        best_index, best_key = 0, (0.0, 0.0)
        best_model = merged_model if keep_best_model else None
        if log is not None:
            log(f"[no calibration] task scores {_show(reference)}: score 0 (the reference)")
    for index, (point, config) in enumerate(zip(points, configs, strict=True)):
        start = time.perf_counter()
        candidate = copy.deepcopy(merged_model)
        calibrated = FeatCalCalibrator(candidate, base_source, expert_sources, batches_for(config), config,
                                       **kwargs).calibrate()
        score, key, scores = _rank(validation_fn(calibrated), criterion, reference, table, greater_is_better)
        seconds = time.perf_counter() - start
        table.append({**point, **({} if scores is None else {"task_scores": scores}), "score": score,
                      "seconds": seconds})
        if log is not None:
            extra = "" if scores is None else f" task scores {_show(scores)},"
            log(f"[{index + 1}/{len(points)}] {point}:{extra} score {score:.6g} ({seconds:.1f} s)")
        if best_index is None or _ranks_higher(key, best_key):
            best_index, best_key = len(table) - 1, key
            best_model = calibrated if keep_best_model else None
        del candidate, calibrated
    assert best_index is not None
    uncalibrated = reference is not None and best_index == 0
    point_index = best_index - (1 if reference is not None else 0)
    return TuningResult(
        best_config=None if uncalibrated else configs[point_index],
        best_params={} if uncalibrated else dict(points[point_index]),
        best_score=table[best_index]["score"],
        table=table,
        best_model=best_model,
        greater_is_better=greater_is_better or criterion == "no_harm",
    )


def _rank(
    returned: Any, criterion: str, reference: dict[str, float] | None, table: list[dict[str, Any]],
    greater_is_better: bool,
) -> tuple[float, tuple[float, ...], dict[str, float] | None]:
    """One candidate's value of the criterion, the key it is ranked by (higher wins: (value,) or, for
    "no_harm", (value, mean gain)) and its per-task scores (None for criterion "score")."""
    if criterion == "score":
        score = _real(returned, "`validation_fn`")
        return score, (score if greater_is_better or math.isnan(score) else -score,), None
    scores = _task_scores(returned, reference if reference is not None else _first_scores(table), criterion)
    if reference is not None:  # "no_harm": gains are higher-is-better whatever the scores' direction
        score = no_harm_score(scores, reference, greater_is_better)
        return score, (score, _mean_gain(scores, reference, greater_is_better)), scores
    score = math.fsum(scores.values()) / len(scores)
    return score, (score if greater_is_better or math.isnan(score) else -score,), scores


def no_harm_score(scores: Mapping[str, float], reference: Mapping[str, float], greater_is_better: bool = True) -> float:
    """The "no_harm" criterion: min over tasks of (score − reference score), the reference being the
    merged model's own; with `greater_is_better=False` (losses) min over tasks of (reference − score).
    Negative: some task lost that much; ≥ 0: no task lost. NaN when any score is NaN."""
    gains = _gains(scores, reference, greater_is_better)
    return math.nan if any(math.isnan(g) for g in gains) else min(gains)


def _gains(scores: Mapping[str, float], reference: Mapping[str, float], greater_is_better: bool) -> list[float]:
    sign = 1.0 if greater_is_better else -1.0
    return [sign * (scores[task] - reference[task]) for task in reference]


def _mean_gain(scores: Mapping[str, float], reference: Mapping[str, float], greater_is_better: bool) -> float:
    gains = _gains(scores, reference, greater_is_better)
    return math.fsum(gains) / len(gains)


def _ranks_higher(key: tuple[float, ...], best: tuple[float, ...]) -> bool:
    """Whether `key` beats `best`, compared in order (NaN never beats anything; anything beats NaN)."""
    for value, other in zip(key, best, strict=True):
        if value == other:
            continue
        return _better(value, other, True)
    return False


def _first_scores(table: list[dict[str, Any]]) -> dict[str, float] | None:
    """The per-task scores of the table's first row (None before the first): later rows must name the same tasks."""
    return table[0]["task_scores"] if table else None


def _real(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        try:
            return float(value)  # e.g. a 0-dim tensor or numpy scalar
        except (TypeError, ValueError):
            raise ValueError(f"{what} must return a real number, got {type(value).__name__}.") from None
    return float(value)


def _task_scores(value: Any, expected: Mapping[str, float] | None, criterion: str) -> dict[str, float]:
    """`validation_fn`'s per-task scores as floats; with `expected`, the same tasks as there."""
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"with criterion={criterion!r}, `validation_fn` must return a non-empty mapping task → "
                         f"score, got {type(value).__name__}.")
    scores = {task: _real(score, f"`validation_fn`[{task!r}]") for task, score in value.items()}
    if expected is not None and set(scores) != set(expected):
        raise ValueError(f"`validation_fn` returned scores for tasks {sorted(scores)}, but for {sorted(expected)} "
                         "before: every call must score the same tasks.")
    return scores


def _show(scores: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{task}: {score:.4g}" for task, score in scores.items()) + "}"


def _better(score: float, best: float, greater_is_better: bool) -> bool:
    """Whether `score` beats `best` (NaN never beats anything; anything beats NaN)."""
    if math.isnan(score):
        return False
    if math.isnan(best):
        return True
    return score > best if greater_is_better else score < best


def train_holdout_split(dataset: Any, num_validation: int | float, seed: int = 0) -> tuple[Any, Any]:
    """Cut a task's `datasets.Dataset` into two disjoint parts (first, held-out part).

    One shuffle with `seed`. Use it on data the experts never trained on: a validation split (one
    part to tune on, the other to report), or a train split only when the experts were trained
    without the held-out part — experts trained on a whole train split have memorised it, and
    scores there hide what calibration costs a task.

    Args:
        dataset: the split to cut.
        num_validation: held-out examples (an int) or fraction (a float in (0, 1)).
        seed: shuffle seed.
    """
    size = len(dataset)
    if isinstance(num_validation, float) and not isinstance(num_validation, bool):
        if not 0.0 < num_validation < 1.0:
            raise ValueError(f"`num_validation` as a fraction must be in (0, 1), got {num_validation!r}.")
        count = max(1, int(round(num_validation * size)))
    elif isinstance(num_validation, int) and not isinstance(num_validation, bool):
        count = num_validation
    else:
        raise ValueError(f"`num_validation` must be an int or a fraction, got {num_validation!r}.")
    if not 0 < count < size:
        raise ValueError(f"`num_validation` must leave examples on both sides: {count} of {size}.")
    shuffled = dataset.shuffle(seed=seed)
    return shuffled.select(range(count, size)), shuffled.select(range(count))
