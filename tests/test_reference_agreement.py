"""The library agrees with an independent float64 implementation of the method specification."""

from __future__ import annotations

import pytest

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from reference_featcal import reference_featcal


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
    calibrator = FeatCalCalibrator(
        merged, base if with_base else None, experts, data, FeatCalConfig(), show_progress=False
    )
    calibrated = calibrator.calibrate()
    assert calibrated is merged
    rel = _relative_difference(calibrated, expected)
    assert rel < 5e-6, rel
    # the calibration really moved the model
    assert _relative_difference(base, expected) > 1e-3
    report = calibrator.report.to_dict()["tasks"]
    for task, stages in expected_drift.items():
        assert report[task]["before"] == pytest.approx(stages["before"], rel=1e-5)
        assert report[task]["after"] == pytest.approx(stages["after"], rel=1e-4)


def test_float64_statistics_match_tighter(clip_setting):
    base, experts, merged, data = clip_setting
    expected, _ = reference_featcal(merged, base, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()})
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
    expected, _ = reference_featcal(merged, base, experts, {t: [b["pixel_values"] for b in bs] for t, bs in data.items()}, **kw)
    config = FeatCalConfig(lambda_ratio=0.3, anchor_rho=1.0, teacher_alpha=0.7, final_block_token_weight=0.2)
    FeatCalCalibrator(merged, base, experts, data, config, show_progress=False).calibrate()
    assert _relative_difference(merged, expected) < 5e-6
