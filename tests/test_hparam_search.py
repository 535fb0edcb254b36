"""`tune_featcal`: grid search of λ / ρ / α on held-out *train* data of the offline digits scenario."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from datasets import Dataset

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.hparam_search import DEFAULT_GRID, TuningResult, train_holdout_split, tune_featcal
from hf_featcal.scenarios.digits import accuracy, build_digits_scenario

torch.set_num_threads(1)
# tiny models with 32 examples per task: ridge-set directions are expected and warned about
pytestmark = pytest.mark.filterwarnings("ignore::hf_featcal.FeatCalWarning")

CALIBRATION = 32  # calibration images per task: the first 32 of each task's train split
HELD_OUT = slice(CALIBRATION, CALIBRATION + 200)  # validation: the next 200 train images (never test)
GRID = [
    {"lambda_ratio": 0.05, "anchor_rho": 2.2, "teacher_alpha": 0.25},
    {"lambda_ratio": 0.5, "anchor_rho": 1.0, "teacher_alpha": 0.0},
    {"lambda_ratio": 0.02, "anchor_rho": 1.5, "teacher_alpha": 0.5},
]


@pytest.fixture(scope="module")
def scenario():
    return build_digits_scenario(
        seed=0, tasks=("digits", "rotated", "parity"), calibration_samples=CALIBRATION,
        pretrain_epochs=4, finetune_epochs=4,
    )


def held_out_accuracy(scenario):
    def validation_fn(model) -> float:
        scores = []
        for task in scenario.tasks:
            data = scenario.data[task]
            scores.append(accuracy(model, scenario.heads[task], data.train_images[HELD_OUT],
                                   data.train_labels[HELD_OUT]))
        return sum(scores) / len(scores)

    return validation_fn


def test_tune_returns_argmax_and_reproduces(scenario):
    merged = scenario.task_arithmetic(0.3)
    snapshot = copy.deepcopy(merged.state_dict())
    validation_fn = held_out_accuracy(scenario)
    lines: list[str] = []
    result = tune_featcal(merged, scenario.base, scenario.experts, scenario.calibration, validation_fn, GRID,
                          log=lines.append)

    assert isinstance(result, TuningResult)
    assert len(result.table) == len(GRID) == len(lines)
    scores = [row["score"] for row in result.table]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))  # first of equal maxima
    assert result.best_score == scores[best]
    assert result.best_params == GRID[best]
    for name, value in GRID[best].items():
        assert getattr(result.best_config, name) == value
    assert [{k: row[k] for k in GRID[0]} for row in result.table] == GRID
    assert "*" in result.to_markdown()

    # the merged model was never touched
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in snapshot.items())
    # the returned config reproduces the reported score, and so does the kept model
    again = FeatCalCalibrator(copy.deepcopy(merged), scenario.base, scenario.experts, scenario.calibration,
                              result.best_config, show_progress=False).calibrate()
    assert validation_fn(again) == pytest.approx(result.best_score, abs=1e-12)
    assert validation_fn(result.best_model) == pytest.approx(result.best_score, abs=1e-12)
    # calibration helps on held-out train data at the chosen point
    assert result.best_score >= validation_fn(merged)


def test_minimise_and_mapping_grid(scenario):
    merged = scenario.task_arithmetic(0.3)
    calls = []

    def drift_like(model) -> float:  # a score to minimise; depends on the model's weights
        value = float(sum(p.detach().double().abs().sum() for p in model.parameters()))
        calls.append(value)
        return value

    grid = {"lambda_ratio": [0.05, 1.0], "teacher_alpha": [0.25]}
    result = tune_featcal(merged, scenario.base, scenario.experts, scenario.calibration, drift_like, grid,
                          greater_is_better=False, keep_best_model=False)
    assert [row["lambda_ratio"] for row in result.table] == [0.05, 1.0]
    assert result.best_score == min(calls)
    assert result.best_model is None


def test_grid_errors_before_calibrating(scenario):
    merged = scenario.task_arithmetic(0.3)

    def never(model) -> float:  # pragma: no cover - must not be reached
        raise AssertionError("calibrated despite an invalid grid")

    with pytest.raises(ValueError, match="lambda"):
        tune_featcal(merged, scenario.base, scenario.experts, scenario.calibration, never, {"lambda": [0.1]})
    with pytest.raises(ValueError, match="grid point 1 .*teacher_alpha"):
        tune_featcal(merged, scenario.base, scenario.experts, scenario.calibration, never,
                     [{"teacher_alpha": 0.5}, {"teacher_alpha": 2.0}])
    assert set(DEFAULT_GRID) == {"lambda_ratio", "anchor_rho", "teacher_alpha"}


def test_train_holdout_split_is_disjoint():
    ds = Dataset.from_dict({"i": list(range(50))})
    calibration, held_out = train_holdout_split(ds, 10, seed=1)
    assert len(calibration) == 40 and len(held_out) == 10
    assert not set(calibration["i"]) & set(held_out["i"])
    calibration, held_out = train_holdout_split(ds, 0.2)
    assert len(held_out) == 10
    with pytest.raises(ValueError):
        train_holdout_split(ds, 50)


def test_sources_and_batches_are_prepared_once_for_the_grid(scenario, tmp_path, monkeypatch):
    """Experts given as folders are resolved once and `datasets.Dataset` calibration data is batched
    once for the whole grid (once more only for a point that changes the sampling), and every point's
    result equals calibrating it directly."""
    import hf_featcal.experts as experts_module
    import hf_featcal.hparam_search as search_module

    folders = {}
    for task, expert in scenario.experts.items():
        expert.save_pretrained(tmp_path / task)
        folders[task] = str(tmp_path / task)
    data = {
        t: Dataset.from_dict({"pixel_values": scenario.data[t].train_images[:CALIBRATION].numpy()}).with_format("torch")
        for t in scenario.tasks
    }
    resolved, batched = [], []
    original_resolve, original_prepare = experts_module.resolve_checkpoint, search_module.prepare_batches
    monkeypatch.setattr(experts_module, "resolve_checkpoint",
                        lambda name, *a, **k: resolved.append(name) or original_resolve(name, *a, **k))
    monkeypatch.setattr(search_module, "prepare_batches",
                        lambda task, *a, **k: batched.append(task) or original_prepare(task, *a, **k))
    merged = scenario.task_arithmetic(0.3)
    grid = [{"lambda_ratio": 0.05}, {"lambda_ratio": 0.5}, {"lambda_ratio": 0.05, "batch_size": 8}]
    scores = {}

    def validation_fn(model):
        scores[len(scores)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return float(len(scores))

    tune_featcal(merged, scenario.base, folders, data, validation_fn, grid, log=None)
    assert sorted(resolved) == sorted(folders.values())  # one resolution per expert folder
    assert sorted(batched) == sorted(list(scenario.tasks) * 2)  # once, and once more for batch_size 8
    for index, point in enumerate(grid):  # each point as a direct calibration from the folders
        direct = FeatCalCalibrator(copy.deepcopy(merged), scenario.base, folders, data,
                                   dataclasses.replace(FeatCalConfig(), **point), show_progress=False).calibrate()
        for key, value in direct.state_dict().items():
            assert torch.equal(value, scores[index][key]), (index, key)


def test_the_old_module_path_gives_the_same_names():
    """`hf_featcal.tuning` (the documented path before the module was named for what it holds) still
    imports the search's public names, as the same objects."""
    import hf_featcal.hparam_search as search_module
    import hf_featcal.tuning as old_path

    for name in search_module.__all__:
        assert getattr(old_path, name) is getattr(search_module, name)
