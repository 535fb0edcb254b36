"""Long phases show a progress bar (hf_featcal.progress): a merge's per-tensor loop and the scenarios'
training loops, on stderr, counting what they do; transformers' ``disable_progress_bar()`` (which
``--quiet`` sets) hides them."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
from transformers import CLIPVisionModel
from transformers.utils import logging as hf_logging

from hf_featcal.merging import merge_models
from hf_featcal.scenarios.digits import build_digits_scenario
from testing_utils import perturbed, tiny_vision_config

SMALL_DIGITS = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    pretrain_epochs=2, finetune_epochs=1, pretrain_size=200)


@contextlib.contextmanager
def progress_bars(enabled: bool):
    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def final_count(stderr: str, description: str) -> str:
    """The last ``done/total`` a bar labelled `description` printed."""
    counts = re.findall(re.escape(description) + r"[^\r\n]*?(\d+/\d+)", stderr)
    assert counts, f"no bar {description!r} in stderr:\n{stderr[-2000:]}"
    return counts[-1]


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_a_merge_counts_its_tensors_on_stderr(method, generator, capsys):
    base = CLIPVisionModel(tiny_vision_config()).eval()
    experts = {"a": perturbed(base, generator, 0.02), "b": perturbed(base, generator, 0.02)}
    floating = sum(1 for value in base.state_dict().values() if torch.is_floating_point(value))
    capsys.readouterr()
    with progress_bars(True):
        merge_models(base, experts, method)
    assert final_count(capsys.readouterr().err, f"Merging ({method})") == f"{floating}/{floating}"


def test_svc_counts_its_matrices_and_regmean_its_experts(clip_setting, capsys):
    from hf_featcal.merging import regmean_merging, singular_value_calibration

    base, experts, merged, data = clip_setting
    matrices = sum(1 for _, p in base.named_parameters() if p.dim() == 2)
    capsys.readouterr()
    with progress_bars(True):
        singular_value_calibration(merged, base, experts)
        regmean_merging(base, experts, data)
    err = capsys.readouterr().err
    assert final_count(err, "SVC") == f"{matrices}/{matrices}"
    assert final_count(err, "RegMean: Grams") == f"{len(experts)}/{len(experts)}"


def test_a_merge_is_silent_with_progress_bars_off(generator, capsys):
    base = CLIPVisionModel(tiny_vision_config()).eval()
    experts = {"a": perturbed(base, generator, 0.02)}
    capsys.readouterr()
    with progress_bars(False):
        merge_models(base, experts, "task_arithmetic")
    assert capsys.readouterr().err == ""


def test_building_the_digits_scenario_shows_each_training_phase(capsys):
    capsys.readouterr()
    with progress_bars(True):
        scenario = build_digits_scenario(seed=3, tasks=("digits", "inverted"), **SMALL_DIGITS)
    err = capsys.readouterr().err
    batch = scenario.settings.batch_size
    pretrain_steps = 2 * math.ceil(len(scenario.pretrain_images) / batch)
    assert final_count(err, "Pre-training the base") == f"{pretrain_steps}/{pretrain_steps}"
    for task in ("digits", "inverted"):
        steps = math.ceil(len(scenario.data[task].train_images) / batch)
        assert final_count(err, f"Fine-tuning the {task!r} expert") == f"{steps}/{steps}"

    with progress_bars(False):
        build_digits_scenario(seed=3, tasks=("digits",), **SMALL_DIGITS)
    assert capsys.readouterr().err == ""


def test_building_the_real_weights_scenario_shows_each_expert(capsys):
    from hf_featcal.scenarios.minilm import build_minilm_scenario, missing_real_weights_packages

    if missing_real_weights_packages():
        pytest.skip(f"needs {missing_real_weights_packages()}")
    capsys.readouterr()
    with progress_bars(True):
        build_minilm_scenario(seed=0, tasks=("turn",), finetune_steps=3, max_length=8, batch_size=2,
                              calibration_samples=2)
    assert final_count(capsys.readouterr().err, "Fine-tuning the 'turn' expert") == "3/3"
