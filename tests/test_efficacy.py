"""Efficacy on a small but real multi-task setting: experts fine-tuned from one base on different
digit tasks (scikit-learn's bundled digits), merged by Task Arithmetic, then calibrated."""

from __future__ import annotations

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.scenarios.digits import build_digits_scenario


@pytest.fixture(scope="module")
def scenario():
    return build_digits_scenario(seed=0)


def test_featcal_raises_accuracy_and_lowers_last_block_drift(scenario):
    merged = scenario.task_arithmetic(0.3)
    given = scenario.task_arithmetic(0.3)
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
    # Measured over seeds 0–4 (`python benchmarks/scenario_spread.py --scenarios digits`): FeatCal − TA
    # +3.0 … +6.0 points; the report's last-block drift (every token) falls by 3.7–6.7 % over all
    # tasks, but for single tasks by as little as 0.6 % (the class token is what this pooled model's
    # last block is fitted for); the class-token distance to each expert falls by 10–12 % on the mean.
    # The claims are the comparisons, each with its margin outside that spread.
    assert mean(calibrated_scores) > mean(merged_scores)
    tasks = calibrator.report.tasks
    assert sum(d["after"][-1] for d in tasks.values()) < sum(d["before"][-1] for d in tasks.values()), tasks

    def class_token(model, images):  # what the heads read, from the full model's own forward
        with torch.no_grad():
            return model(pixel_values=images, output_hidden_states=True).hidden_states[-1][:, 0]

    ratios = []
    for task in scenario.tasks:
        images = scenario.data[task].test_images
        target = class_token(scenario.experts[task], images)
        distance = lambda model, images=images, target=target: float(  # noqa: E731
            (class_token(model, images) - target).norm(dim=-1).mean())
        ratios.append(distance(calibrated) / distance(given))
    assert sum(ratios) / len(ratios) <= 0.95, ratios
