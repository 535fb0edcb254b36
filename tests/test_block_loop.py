"""The block loop's stages each own what they produce: the merged model's input path runs once per
batch (the construction's check is the first stack's student stream), and a warning of the solve
stage points at the user's line, however deep in the package it is raised."""

from __future__ import annotations

import copy
import inspect

import pytest

from hf_featcal import FeatCalCalibrator, FeatCalWarning


def test_the_merged_input_path_runs_once_per_batch(clip_setting):
    """The embeddings of the merged model run once per calibration batch over construction and
    `calibrate()` together (the experts' and the base's input paths are their own modules)."""
    base, experts, merged, data = clip_setting
    model = copy.deepcopy(merged)
    calls = []
    embeddings = next(m for name, m in model.named_modules() if name.endswith("embeddings"))
    embeddings.register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))
    calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
    calibrator.calibrate()
    assert calls == [len(batch["pixel_values"]) for task in experts for batch in data[task]]


def test_a_solve_warning_points_at_the_line_that_called_calibrate(clip_setting):
    base, experts, merged, data = clip_setting
    few = {t: [{"pixel_values": bs[0]["pixel_values"][:1]}] for t, bs in data.items()}  # fewer tokens than fc2 is wide
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, few, show_progress=False)

    def run():  # one frame more outside the package: the warning points at the first outside frame
        calibrator.calibrate()
        return inspect.currentframe().f_lineno - 1

    with pytest.warns(FeatCalWarning, match="weighted tokens") as caught:
        line = run()
    places = {(w.filename, w.lineno) for w in caught if "weighted tokens" in str(w.message)}
    assert places == {(__file__, line)}


def test_a_solve_warning_raised_through_another_library_function_points_at_its_caller(clip_setting):
    """`tune_featcal` calibrates inside the package: its warnings point at the user's call of it,
    not at a line of the library."""
    from hf_featcal.tuning import tune_featcal

    base, experts, merged, data = clip_setting
    few = {t: [{"pixel_values": bs[0]["pixel_values"][:1]}] for t, bs in data.items()}
    with pytest.warns(FeatCalWarning, match="weighted tokens") as caught:
        line = inspect.currentframe().f_lineno + 1
        tune_featcal(merged, base, experts, few, lambda model: 0.0, [{"lambda_ratio": 0.05}], log=lambda message: None)
    places = {(w.filename, w.lineno) for w in caught if "weighted tokens" in str(w.message)}
    assert places == {(__file__, line)}
