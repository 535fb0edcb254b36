"""The library agrees with an independent float64 implementation of the method specification."""

from __future__ import annotations

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from reference_featcal import reference_featcal


def check_steps_from_the_merged_model(given: dict, calibrated: dict, expected: dict, step_tol: float) -> None:
    """Compare with the merged model as given (state dicts, same keys): every block tensor was moved by
    the calibration, and the library's step from the given value matches the reference's step to
    `step_tol` relative; every tensor outside the blocks is exactly the given one."""
    for name, before in given.items():
        got, want, before = (calibrated[name].detach().double(), expected[name].detach().double(),
                             before.detach().double())
        if name.startswith("encoder.layers."):
            step = float((want - before).norm())
            assert step > 1e-3 * float(before.norm()), (name, "the reference did not move it")
            assert float((got - want).norm()) <= step_tol * step, (name, float((got - want).norm()) / step)
        else:
            assert torch.equal(got, before), (name, "outside the blocks: must keep the merged value")


def _relative_difference(model, reference) -> float:
    ref = dict(reference.named_parameters())
    num = den = 0.0
    for name, p in model.named_parameters():
        diff = p.detach().double() - ref[name].detach()
        num += float(diff.square().sum())
        den += float(ref[name].detach().square().sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("with_base", [True, False])
def test_default_settings_match_the_specification(clip_setting, with_base):
    base, experts, merged, data = clip_setting
    expected, expected_drift = reference_featcal(
        merged, base if with_base else None, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()}
    )
    given = {k: v.clone() for k, v in merged.state_dict().items()}
    calibrator = FeatCalCalibrator(
        merged, base if with_base else None, experts, data, FeatCalConfig(), show_progress=False
    )
    calibrated = calibrator.calibrate()
    assert calibrated is merged
    rel = _relative_difference(calibrated, expected)
    assert rel < 5e-6, rel
    check_steps_from_the_merged_model(given, calibrated.state_dict(), expected.state_dict(), step_tol=1e-3)
    report = calibrator.report.to_dict()["tasks"]
    for task, stages in expected_drift.items():
        assert report[task]["before"] == pytest.approx(stages["before"], rel=1e-5)
        assert report[task]["after"] == pytest.approx(stages["after"], rel=1e-4)


def test_float64_statistics_match_tighter(clip_setting):
    base, experts, merged, data = clip_setting
    expected, _ = reference_featcal(merged, base, experts,
                                    {t: [b["pixel_values"] for b in bs] for t, bs in data.items()})
    merged64 = merged.double()
    data64 = {t: [{"pixel_values": b["pixel_values"].double()} for b in bs] for t, bs in data.items()}
    FeatCalCalibrator(
        merged64, base.double(), {t: e.double() for t, e in experts.items()}, data64,
        FeatCalConfig(compute_dtype="float64"), show_progress=False,
    ).calibrate()
    assert _relative_difference(merged64, expected) < 1e-8


def test_non_default_hyperparameters_match(clip_setting):
    base, experts, merged, data = clip_setting
    kw = dict(lam=0.3, rho=1.0, alpha=0.7, last_weight=0.2)
    expected, _ = reference_featcal(merged, base, experts,
                                    {t: [b["pixel_values"] for b in bs] for t, bs in data.items()}, **kw)
    config = FeatCalConfig(lambda_ratio=0.3, anchor_rho=1.0, teacher_alpha=0.7, final_block_token_weight=0.2)
    given = {k: v.clone() for k, v in merged.state_dict().items()}
    FeatCalCalibrator(merged, base, experts, data, config, show_progress=False).calibrate()
    assert _relative_difference(merged, expected) < 5e-6
    check_steps_from_the_merged_model(given, merged.state_dict(), expected.state_dict(), step_tol=1e-3)
