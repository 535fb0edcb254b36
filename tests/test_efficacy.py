"""Efficacy on a small but real multi-task setting: experts fine-tuned from one base on different
digit tasks (scikit-learn's bundled digits), merged by Task Arithmetic, then calibrated."""

from __future__ import annotations

import pytest

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.toy import build_digits_scenario


@pytest.fixture(scope="module")
def scenario():
    return build_digits_scenario(seed=0)


def test_featcal_raises_accuracy_and_lowers_last_block_drift(scenario):
    merged = scenario.task_arithmetic(0.3)
    merged_scores = scenario.evaluate(merged)
    calibrator = FeatCalCalibrator(
        merged, scenario.base, scenario.experts, scenario.calibration,
        FeatCalConfig(num_samples_per_task=64), show_progress=False,
    )
    calibrated = calibrator.calibrate()
    calibrated_scores = scenario.evaluate(calibrated)
    mean = lambda scores: sum(scores.values()) / len(scores)  # noqa: E731
    print(f"\nTA mean {mean(merged_scores):.4f} → FeatCal {mean(calibrated_scores):.4f}")
    print("TA", merged_scores, "\nFeatCal", calibrated_scores, "\nexperts", scenario.evaluate_experts())
    assert mean(calibrated_scores) > mean(merged_scores) + 0.01
    for task, stages in calibrator.report.tasks.items():
        assert stages["after"][-1] < stages["before"][-1], task
