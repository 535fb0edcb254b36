"""A merged model dispatched by accelerate with CPU or disk offload: calibrated one block at a time,
written back to the offloaded weights, same result as the model in memory."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import cpu_offload, dispatch_model

from hf_featcal import FeatCalCalibrator, FeatCalError
from hf_featcal.parameters import ModelParameters
from testing_utils import assert_same_up_to_rounding


def _outputs(model, data):
    with torch.no_grad():
        return torch.cat([model(pixel_values=b["pixel_values"]).last_hidden_state for bs in data.values() for b in bs])


def _dispatched(merged, kind, tmp_path):
    model = copy.deepcopy(merged)
    if kind == "cpu":
        return cpu_offload(model, execution_device=torch.device("cpu"))
    device_map = {"embeddings": "cpu", "pre_layrnorm": "cpu", "encoder.layers.0": "disk", "encoder.layers.1": "disk",
                  "post_layernorm": "cpu"}
    return dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path / "offload"))


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("experts_on_disk", [False, True])
def test_offloaded_merged_model_matches_in_memory(clip_setting, tmp_path, kind, experts_on_disk):
    base, experts, merged, data = clip_setting
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    if experts_on_disk:
        for task, expert in experts.items():
            expert.save_pretrained(tmp_path / task)
        experts = {task: str(tmp_path / task) for task in experts}
    model = _dispatched(merged, kind, tmp_path)
    assert ModelParameters(model).dispatched
    assert model.encoder.layers[1].mlp.fc2.weight.is_meta
    before = _outputs(model, data)
    calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
    out = calibrator.calibrate()
    assert out is model and model.encoder.layers[1].mlp.fc2.weight.is_meta  # still offloaded
    after, want = _outputs(model, data), _outputs(reference, data)
    assert not torch.allclose(before, after)
    # (accelerate's hooks replace the offloaded patch embedding's forward, which then enters the streams by its
    # convolution, the in-memory one by the same sums as one product: equal up to float32 rounding)
    assert_same_up_to_rounding({"outputs": after}, {"outputs": want})
    params = ModelParameters(model)
    assert_same_up_to_rounding({name: params.read(name) for name, _ in reference.named_parameters()},
                               {name: value.detach() for name, value in reference.named_parameters()})


def base_failing_in_block_2(base):
    """A copy of the base whose anchor overflows in block 2's norm: calibration fails at that solve
    (a non-finite solution), after block 1 was written. (A NaN weight would be refused up front.)"""
    broken = copy.deepcopy(base)
    with torch.no_grad():
        broken.encoder.layers[1].layer_norm2.bias[0] = 3.4e38  # finite
    return broken


def test_failure_restores_offloaded_weights(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    model = _dispatched(merged, "disk", tmp_path)
    params = ModelParameters(model)
    state = {name: params.read(name).clone() for name, _ in model.named_parameters()}
    broken = base_failing_in_block_2(base)
    with pytest.raises(FeatCalError):
        FeatCalCalibrator(model, broken, experts, data, show_progress=False).calibrate()
    for name, value in state.items():
        assert torch.equal(params.read(name), value), name
