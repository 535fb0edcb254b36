"""`FeatCalConfig.task_weights`: task i's terms of the joint objective multiplied by ω_i (mean 1 over the
tasks), checked against the float64 reference written from the method's formulas and against giving
the task twice; equal weights are the unweighted run bit for bit; bad weights are refused early."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.cli import main as cli_main
from hf_featcal.recipes import RecipeError, parse_recipe
from reference_featcal import reference_featcal
from testing_utils import as_float64, assert_same_up_to_rounding

# tiny models with a few examples: ridge-set directions are expected and warned about
pytestmark = pytest.mark.filterwarnings("ignore::hf_featcal.FeatCalWarning")


def _calibrate(merged, base, experts, data, **fields):
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(**fields), show_progress=False)
    calibrator.calibrate()
    return model, calibrator


def _relative_difference(model, reference) -> float:
    ref = dict(reference.named_parameters())
    num = den = 0.0
    for name, p in model.named_parameters():
        num += float((p.detach().double() - ref[name].detach().double()).square().sum())
        den += float(ref[name].detach().double().square().sum())
    return math.sqrt(num / den)


# ---------------------------------------------------------------------------------- the objective
def test_weighted_run_matches_the_float64_reference(clip_setting):
    """Every Linear, bias and LayerNorm of every block against the naive float64 FeatCal with each
    task's terms multiplied by ω_i = w_i·T / Σ w (the reference normalises on its own)."""
    base, experts, merged, data = as_float64(*clip_setting)
    weights = {"cars": 3.0, "dtd": 0.5}
    pixels = {t: [b["pixel_values"] for b in bs] for t, bs in data.items()}
    expected, _ = reference_featcal(merged, base, experts, pixels, task_weights=weights)
    unweighted, _ = reference_featcal(merged, base, experts, pixels)
    model, _ = _calibrate(merged, base, experts, data, compute_dtype="float64", task_weights=weights)
    assert _relative_difference(model, expected) < 1e-8
    # the weights matter here: the unweighted solution lies far outside that tolerance
    assert _relative_difference(unweighted, expected) > 1e-4


@pytest.mark.parametrize("granularity", ["block", "module"])
def test_weight_two_is_the_task_given_twice(clip_setting, granularity):
    """Weights {cars: 2} on tasks {cars, dtd} (ω = 4/3, 2/3) at λ give the model that tasks {cars, cars
    again, dtd} (same expert, same data) give at λ·3/2: the two objectives are proportional."""
    base, experts, merged, data = as_float64(*clip_setting)
    common = {"compute_dtype": "float64", "epsilon": 1e-14, "granularity": granularity}
    weighted, _ = _calibrate(merged, base, experts, data, lambda_ratio=0.05, task_weights={"cars": 2}, **common)
    twice_experts = {"cars": experts["cars"], "cars_again": copy.deepcopy(experts["cars"]), "dtd": experts["dtd"]}
    twice_data = {"cars": data["cars"], "cars_again": data["cars"], "dtd": data["dtd"]}
    twice, _ = _calibrate(merged, base, twice_experts, twice_data, lambda_ratio=0.05 * 3 / 2, **common)
    assert_same_up_to_rounding(weighted.state_dict(), twice.state_dict(), rtol=1e-9)
    unweighted, _ = _calibrate(merged, base, experts, data, lambda_ratio=0.05, **common)
    assert _relative_difference(unweighted, twice) > 1e-4


def test_equal_weights_are_the_unweighted_run_bit_for_bit(clip_setting):
    base, experts, merged, data = clip_setting
    plain, plain_calibrator = _calibrate(merged, base, experts, data)
    for weights in ({}, {"cars": 1.0, "dtd": 1.0}, {"dtd": 1}, {"cars": 2.5, "dtd": 2.5}):
        model, calibrator = _calibrate(merged, base, experts, data, task_weights=weights)
        for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
            assert torch.equal(p, q), (weights, name)
        assert calibrator.report.to_dict() == plain_calibrator.report.to_dict()
    shifted, _ = _calibrate(merged, base, experts, data, task_weights={"cars": 1.1})
    assert not all(torch.equal(p, q) for p, q in zip(shifted.parameters(), plain.parameters(), strict=True))


def test_normalised_weights():
    config = FeatCalConfig(task_weights={"a": 3, "c": 0})
    assert config.task_weights == {"a": 3.0, "c": 0.0}  # ints as floats: one setting, one JSON text
    assert config.normalised_task_weights(["a", "b", "c"]) == pytest.approx({"a": 9 / 4, "b": 3 / 4, "c": 0.0})
    assert FeatCalConfig().normalised_task_weights(["a", "b"]) == {"a": 1.0, "b": 1.0}


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": -1.0}, r"task_weights\['a'\] must be a finite real number ≥ 0"),
        ({"a": float("nan")}, r"task_weights\['a'\] must be a finite real number ≥ 0"),
        ({"a": float("inf")}, r"task_weights\['a'\] must be a finite real number ≥ 0"),
        ({"a": True}, r"task_weights\['a'\] must be a finite real number ≥ 0"),
        ({"a": "2"}, r"task_weights\['a'\] must be a finite real number ≥ 0"),
        ({"": 1.0}, r"task_weights must be None or a mapping task name → weight"),
        ({1: 1.0}, r"task_weights must be None or a mapping task name → weight"),
        ([("a", 1.0)], r"task_weights must be None or a mapping task name → weight"),
    ],
)
def test_bad_weights_are_refused_naming_the_field(weights, message):
    with pytest.raises(ValueError, match=r"FeatCalConfig\." + message):
        FeatCalConfig(task_weights=weights)
    config = FeatCalConfig(task_weights={"a": 2.0})
    with pytest.raises(ValueError, match=message):
        config.task_weights = weights
    assert config.task_weights == {"a": 2.0}  # the refused assignment kept the old value


def test_unknown_or_all_zero_weights_are_refused_before_any_model_is_read(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    missing = {t: str(tmp_path / f"no-such-{t}") for t in experts}  # reading these would fail differently
    with pytest.raises(ValueError, match=r"FeatCalConfig.task_weights names \['car'\], which are not tasks"):
        FeatCalCalibrator(merged, base, missing, data, FeatCalConfig(task_weights={"car": 2.0}))
    with pytest.raises(ValueError, match=r"FeatCalConfig.task_weights gives every task weight 0"):
        FeatCalCalibrator(merged, base, missing, data, FeatCalConfig(task_weights={"cars": 0.0, "dtd": 0}))
    # a change after construction is checked again by calibrate(), which leaves the model as it was
    before = copy.deepcopy(merged.state_dict())
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(), show_progress=False)
    calibrator.config.task_weights = {"dtd": 2.0, "svhn": 1.0}
    with pytest.raises(ValueError, match=r"\['svhn'\], which are not tasks"):
        calibrator.calibrate()
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in before.items())


# ---------------------------------------------------------------------------------- identity and records
def test_a_checkpoint_of_other_weights_is_refused(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    folder = tmp_path / "ckpt"

    def run(weights):
        model = copy.deepcopy(merged)
        FeatCalCalibrator(model, base, experts, data, FeatCalConfig(task_weights=weights), show_progress=False,
                          checkpoint_dir=folder).calibrate()
        return model

    first = run({"cars": 2.0})
    for other in ({"cars": 3.0}, None):
        with pytest.raises(ValueError, match=r"holds a checkpoint of a different run"):
            run(other)
    again = run({"cars": 2})  # the same setting (2 == 2.0): the finished checkpoint is taken as it is
    for p, q in zip(again.parameters(), first.parameters(), strict=True):
        assert torch.equal(p, q)


def test_weights_round_trip_and_reach_the_model_card(clip_setting, tmp_path):
    config = FeatCalConfig(task_weights={"cars": 2.0})
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "featcal_config.json").read_text())["task_weights"] == {"cars": 2.0}
    assert FeatCalConfig.from_pretrained(tmp_path) == config
    base, experts, merged, data = clip_setting
    _, calibrator = _calibrate(merged, base, experts, data, task_weights={"cars": 2.0})
    card = str(calibrator.create_model_card())
    assert "| task_weights | {'cars': 2.0} |" in card


_RECIPE = {
    "model_family": "clip",
    "base": "org/clip-base",
    "experts": {"mnist": "org/clip-mnist", "dtd": "org/clip-dtd"},
    "merge": {"method": "task_arithmetic"},
    "calibration": {"default": {"dataset": "org/{task}-data"}},
}


def test_recipes_take_task_weights():
    recipe = parse_recipe({**copy.deepcopy(_RECIPE), "featcal": {"task_weights": {"mnist": 2}}})
    assert recipe.featcal.task_weights == {"mnist": 2.0}
    with pytest.raises(RecipeError) as err:
        parse_recipe({**copy.deepcopy(_RECIPE), "featcal": {"task_weights": {"cars": 2}}})
    assert err.value.key == "featcal.task_weights.cars"
    with pytest.raises(RecipeError) as err:
        parse_recipe({**copy.deepcopy(_RECIPE), "featcal": {"task_weights": {"mnist": -2}}})
    assert err.value.key == "featcal.task_weights"


def test_the_calibrate_command_takes_task_weights(capsys):
    from hf_featcal.cli.app import build_parser
    from hf_featcal.cli.calibrate import _featcal_config

    argv = ["calibrate", "--model", "org/merged", "--base", "org/base", "--expert", "a=org/expert-a",
            "--expert", "b=org/expert-b", "--data", "a=org/data", "--data", "b=org/data", "--output-dir", "unused"]
    args = build_parser().parse_args([*argv, "--task-weight", "a=2", "--task-weights", "b=0.5"])
    assert _featcal_config(args).task_weights == {"a": 2.0, "b": 0.5}
    for flag, error in [("c=2", "task weight 'c' (--task-weight or --featcal-config): no --expert named 'c'"),
                        ("a=two", "--task-weight a=two: the weight must be a number"),
                        ("a=-1", "featcal.task_weights: FeatCalConfig.task_weights['a'] must be a finite real")]:
        assert cli_main([*argv, "--task-weight", flag]) == 2
        assert error in capsys.readouterr().err
