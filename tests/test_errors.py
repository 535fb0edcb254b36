"""Every bad input gets a clear error naming the argument, before any expensive work, and a failing
calibration leaves the caller's model exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import BertConfig, BertModel, CLIPVisionModel, GPT2Config, GPT2Model

from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalError
from testing_utils import tiny_vision_config


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, state):
    now = model.state_dict()
    assert set(now) == set(state)
    for k, v in state.items():
        assert torch.equal(now[k], v), k


def test_unsupported_architecture_names_the_supported_ones(clip_setting):
    _, experts, _, data = clip_setting
    gpt2 = GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(
        ValueError,
        match=r"`model` has unsupported architecture GPT2Model.*supported model types: bert, clip, clip_vision_model, "
              r"llama",
    ):
        FeatCalCalibrator(gpt2, None, experts, data)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"hidden_size": 24, "num_attention_heads": 2}, r"experts\['cars'\].*hidden_size: merged 16 vs 24"),
        ({"num_hidden_layers": 3}, r"experts\['cars'\].*num_hidden_layers"),
        ({"patch_size": 2}, r"experts\['cars'\].*patch_size"),
    ],
)
def test_mismatched_expert_config(clip_setting, overrides, match):
    base, experts, merged, data = clip_setting
    experts = dict(experts)
    experts["cars"] = CLIPVisionModel(tiny_vision_config(**overrides))
    with pytest.raises(ValueError, match=match):
        FeatCalCalibrator(merged, base, experts, data)


def test_mismatched_architecture_and_base(clip_setting):
    base, experts, merged, data = clip_setting
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                vocab_size=50))
    with pytest.raises(ValueError,
                       match=r"`base_model` has model_type 'bert', which does not match the merged CLIPVisionModel"):
        FeatCalCalibrator(merged, bert, experts, data)
    gpt2 = GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"`base_model` has unsupported architecture"):
        FeatCalCalibrator(merged, gpt2, experts, data)
    with pytest.raises(ValueError, match=r"`base_model` has a different configuration"):
        FeatCalCalibrator(merged, CLIPVisionModel(tiny_vision_config(intermediate_size=48)), experts, data)


def test_mismatched_parameter_shapes(clip_setting):
    base, experts, merged, data = clip_setting
    odd = copy.deepcopy(experts["dtd"])
    odd.encoder.layers[1].mlp.fc2 = torch.nn.Linear(32, 16, bias=False)  # same config, different parameters
    with pytest.raises(ValueError, match=r"`experts\['dtd'\]` lacks parameters.*fc2\.bias"):
        FeatCalCalibrator(merged, base, {**experts, "dtd": odd}, data)


def test_task_without_data_or_expert(clip_setting):
    base, experts, merged, data = clip_setting
    with pytest.raises(ValueError,
                       match=r"tasks \['dtd'\] have an expert in `experts` but no entry in `calibration_data`"):
        FeatCalCalibrator(merged, base, experts, {"cars": data["cars"]})
    with pytest.raises(ValueError, match=r"tasks \['svhn'\] have data in `calibration_data` but no expert"):
        FeatCalCalibrator(merged, base, experts, {**data, "svhn": data["cars"]})
    with pytest.raises(ValueError, match=r"`experts` must be a non-empty mapping"):
        FeatCalCalibrator(merged, base, {}, data)


def test_empty_calibration_sets(clip_setting):
    base, experts, merged, data = clip_setting
    with pytest.raises(ValueError, match=r"calibration_data\['dtd'\] is empty"):
        FeatCalCalibrator(merged, base, experts, {**data, "dtd": []})
    empty = Dataset.from_dict({"pixel_values": []})
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\] is empty"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": empty})


def test_batches_the_model_cannot_take(clip_setting, generator):
    base, experts, merged, data = clip_setting
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\] item 0: the batch has no tensor 'pixel_values'"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": [{"input_ids": torch.ones(2, 3)}]})
    wrong_channels = [{"pixel_values": torch.randn(2, 1, 8, 8, generator=generator)}]
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\]: the merged model cannot take its batches"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": wrong_channels})
    with pytest.raises(TypeError, match=r"calibration_data\['cars'\] item 0 must be a batch"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": [torch.randn(2, 3, 8, 8)]})
    with pytest.raises(TypeError, match=r"calibration_data\['cars'\] must be a datasets.Dataset or an iterable"):
        FeatCalCalibrator(merged, base, experts, {**data, "cars": 3})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lambda_ratio": -1.0}, r"lambda_ratio must be ≥ 0"),
        ({"anchor_rho": float("nan")}, r"anchor_rho must be a finite real"),
        ({"teacher_alpha": 1.5}, r"teacher_alpha must be in \[0, 1\]"),
        ({"final_block_token_weight": -0.1}, r"final_block_token_weight must be in \[0, 1\]"),
        ({"epsilon": 0.0}, r"epsilon must be > 0"),
        ({"num_samples_per_task": 0}, r"num_samples_per_task must be a positive integer or None"),
        ({"batch_size": 0}, r"batch_size must be a positive integer"),
        ({"target_modules": "("}, r"target_modules is not a valid regular expression"),
        ({"exclude_modules": []}, r"exclude_modules must be None, a regex string or a non-empty list"),
        ({"layers_to_transform": "0"}, r"layers_to_transform must be None, an int or a non-empty list"),
        ({"compute_dtype": "float16"}, r"compute_dtype must be 'float32' or 'float64'"),
        ({"calibrate_bias": "yes"}, r"calibrate_bias must be a bool"),
    ],
)
def test_invalid_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeatCalConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"target_modules": ["fc2", "gate_proj"]}, r"target_modules entry 'gate_proj' matches no module"),
        ({"exclude_modules": r"mlp\.down_proj"}, r"exclude_modules entry 'mlp\\\\.down_proj' matches no module"),
        ({"layers_to_transform": [5]}, r"layers_to_transform has block indices \[5\] outside the model's 2 blocks"),
        ({"target_modules": ["layer_norm1"], "calibrate_norms": False}, r"selects no module to calibrate"),
    ],
)
def test_selection_that_matches_nothing(clip_setting, kwargs, match):
    base, experts, merged, data = clip_setting
    with pytest.raises(ValueError, match=match):
        FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(**kwargs))


def test_bad_argument_types(clip_setting):
    base, experts, merged, data = clip_setting
    with pytest.raises(TypeError, match=r"`config` must be a FeatCalConfig"):
        FeatCalCalibrator(merged, base, experts, data, config={"lambda_ratio": 0.1})
    with pytest.raises(TypeError, match=r"`experts\['cars'\]` must be a PreTrainedModel, a local path or a hub id"):
        FeatCalCalibrator(merged, base, {**experts, "cars": 3}, data)
    with pytest.raises(ValueError, match=r"`base_model`: cannot load a model config from '/nonexistent/base'"):
        FeatCalCalibrator(merged, "/nonexistent/base", experts, data)
    with pytest.raises(ValueError, match=r"`device`: .* is not a torch device"):
        FeatCalCalibrator(merged, base, experts, data, device="gpu0")


def test_non_finite_features_are_reported_with_block_and_module(clip_setting):
    base, experts, merged, data = clip_setting
    state = _state(merged)
    bad = copy.deepcopy(data["dtd"])
    bad[1]["pixel_values"][0, 0, 0, 0] = float("nan")
    calibrator = FeatCalCalibrator(merged, base, experts, {**data, "dtd": bad}, show_progress=False)
    with pytest.raises(
        FeatCalError,
        match=r"non-finite values in the features entering block 0 of vision_encoder, module self_attn\.k_proj, "
              r"self_attn\.v_proj, self_attn\.q_proj",
    ):
        calibrator.calibrate()
    _assert_unchanged(merged, state)
    assert calibrator.report is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_expert_or_base_weights_are_named_before_any_solve(clip_setting, tmp_path, bad):
    """Issue 29 item 7: NaN/Inf in an expert's or the base's weights used to surface at that block's
    solve as a "non-finite solution"; now the model and the tensor are named: in memory at construction,
    from a checkpoint when the tensor is first read (before the solve that would use it)."""
    base, experts, merged, data = clip_setting
    state = _state(merged)
    broken = copy.deepcopy(experts["dtd"])
    with torch.no_grad():
        broken.encoder.layers[1].mlp.fc1.weight[0, 0] = bad  # block 0 is solved and written first
    named = (r"`experts\['dtd'\]`.* has non-finite values \(NaN/Inf\) in "
             r"'(vision_model\.)?encoder\.layers\.1\.mlp\.fc1\.weight'")
    with pytest.raises(ValueError, match=named):
        FeatCalCalibrator(merged, base, {**experts, "dtd": broken}, data, show_progress=False)
    broken.save_pretrained(tmp_path / "dtd")
    calibrator = FeatCalCalibrator(merged, base, {**experts, "dtd": str(tmp_path / "dtd")}, data, show_progress=False)
    with pytest.raises(ValueError, match=named):
        calibrator.calibrate()
    _assert_unchanged(merged, state)
    broken_base = copy.deepcopy(base)
    with torch.no_grad():
        broken_base.encoder.layers[1].layer_norm2.bias[3] = bad  # only the anchor
    with pytest.raises(
        ValueError, match=r"`base_model` has non-finite values \(NaN/Inf\) in 'encoder\.layers\.1\.layer_norm2\.bias'"
    ):
        FeatCalCalibrator(merged, broken_base, experts, data, show_progress=False)
    _assert_unchanged(merged, state)


def test_non_finite_solution_is_never_written(clip_setting):
    base, experts, merged, data = clip_setting
    state = _state(merged)
    broken_base = copy.deepcopy(base)
    with torch.no_grad():
        broken_base.encoder.layers[1].layer_norm2.bias[3] = 3.4e38  # finite, but the anchor's solution overflows
    with pytest.raises(FeatCalError, match=r"solution for block 1 of vision_encoder, module layer_norm2"):
        FeatCalCalibrator(merged, broken_base, experts, data, show_progress=False).calibrate()
    _assert_unchanged(merged, state)


def test_interrupt_restores_the_model(clip_setting, monkeypatch):
    base, experts, merged, data = clip_setting
    state = _state(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    original = calibrator._solve_and_write
    calls = []

    def solve_then_interrupt(plan, *args):
        written = original(plan, *args)  # block 0 really gets written ...
        calls.append(plan.block_index)
        if plan.block_index == 1:
            raise KeyboardInterrupt  # ... and the run is interrupted in block 1
        return written

    monkeypatch.setattr(calibrator, "_solve_and_write", solve_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        calibrator.calibrate()
    assert calls == [0, 1]
    _assert_unchanged(merged, state)


def test_calibrate_twice_is_refused(clip_setting):
    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    with pytest.raises(RuntimeError, match="already run"):
        calibrator.calibrate()
