"""The allocation-lean activation forwards (`hf_featcal._kernels.activations`) equal the modules' own forwards
bit for bit, only run while gradients are off, are undone on exit, and are what FeatCal's block
forwards use — without changing a calibrated weight."""

from __future__ import annotations

import copy

import pytest
import torch
from open_clip.transformer import QuickGELU
from transformers.activations import NewGELUActivation, QuickGELUActivation

import hf_featcal._kernels.activations as activations
from hf_featcal import FeatCalCalibrator
from hf_featcal._kernels.activations import lean_activations

ACTIVATIONS = [QuickGELUActivation, QuickGELU, NewGELUActivation]


def _awkward_values(dtype: torch.dtype) -> torch.Tensor:
    """Normal values at several scales plus ±inf, NaN, ±0 and the dtype's extremes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(600, generator=gen) * s for s in (0.01, 1.0, 4.0, 30.0)])
    info = torch.finfo(dtype)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, info.max, -info.max, info.tiny])
    return torch.cat([x.to(dtype), special.to(dtype)]).reshape(8, -1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    )


@pytest.mark.parametrize("cls", ACTIVATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_lean_forward_equals_the_modules_own_bit_for_bit(cls, dtype):
    module = cls()
    x = _awkward_values(dtype)
    expected = module(x)
    with torch.no_grad(), lean_activations(module):
        assert "forward" in module.__dict__  # the lean forward is in place
        got = module(x)
    assert _same_bits(got, expected)
    assert _same_bits(x, _awkward_values(dtype))  # the input is not written


@pytest.mark.parametrize("cls", ACTIVATIONS, ids=lambda c: c.__name__)
def test_the_lean_forward_equals_the_modules_own_under_autocast(cls):
    module, linear = cls(), torch.nn.Linear(8, 8)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = linear(x)  # bfloat16 under autocast
        expected = module(h)
        with lean_activations(module):
            got = module(h)
    assert h.dtype == torch.bfloat16
    assert _same_bits(got, expected)


@pytest.mark.parametrize("cls", ACTIVATIONS, ids=lambda c: c.__name__)
def test_with_gradients_on_the_modules_own_forward_runs_and_backward_works(cls):
    module = cls()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    module(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with lean_activations(module):
        module(x).square().sum().backward()  # the lean in-place chain would break autograd
    assert torch.equal(x.grad, expected)


def test_the_class_forward_is_back_on_exit_also_on_error_and_other_overrides_are_left_alone():
    plain, overridden = QuickGELUActivation(), QuickGELUActivation()

    def own(x):
        return x + 1.0

    overridden.forward = own
    root = torch.nn.Sequential(plain, overridden)
    with pytest.raises(RuntimeError, match="body failed"):
        with lean_activations(root):
            assert "forward" in plain.__dict__
            assert overridden.forward is own
            raise RuntimeError("body failed")
    assert "forward" not in plain.__dict__
    assert overridden.forward is own


def test_a_subclass_with_its_own_forward_is_not_matched():
    class Scaled(QuickGELUActivation):
        def forward(self, x):
            return 2.0 * super().forward(x)

    module = Scaled()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), lean_activations(module):
        assert "forward" not in module.__dict__
        assert torch.equal(module(x), 2.0 * x * torch.sigmoid(1.702 * x))


def _encoder_blocks(model):
    return [m for m in model.modules() if type(m).__name__ in ("CLIPEncoderLayer", "T5Block", "ResidualAttentionBlock")]


def test_whole_blocks_forward_bit_identically(clip_setting):
    """A CLIP encoder layer (QuickGELU) and a gated-GELU T5 block (NewGELU), each as a whole."""
    from transformers import T5EncoderModel

    from test_t5 import t5_config

    _, _, merged, _ = clip_setting
    clip_block = _encoder_blocks(merged)[0]
    t5_block = _encoder_blocks(T5EncoderModel(t5_config()).eval())[1]
    gen = torch.Generator().manual_seed(4)
    for block, x in [(clip_block, torch.randn(3, 5, 16, generator=gen)),
                     (t5_block, torch.randn(3, 7, 16, generator=gen))]:
        assert any(type(m) in (QuickGELUActivation, NewGELUActivation) for m in block.modules())
        with torch.no_grad():
            expected = block(x)[0] if type(block).__name__ == "T5Block" else block(x, None)
            with lean_activations(block):
                got = block(x)[0] if type(block).__name__ == "T5Block" else block(x, None)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = got[0] if isinstance(got, tuple) else got
        assert torch.equal(got, expected)


def test_calibration_runs_the_lean_forwards_and_its_weights_do_not_change(clip_setting, monkeypatch):
    base, experts, merged, data = clip_setting
    seen = []

    def record(module, args, output):
        seen.append("forward" in module.__dict__)

    def calibrated(lean: bool):
        if not lean:
            monkeypatch.setattr(activations, "LEAN_FORWARDS", {})
        model = copy.deepcopy(merged)
        handles = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, QuickGELUActivation)]
        FeatCalCalibrator(model, base, experts, data, show_progress=False).calibrate()
        for handle in handles:
            handle.remove()
        return model.state_dict()

    lean = calibrated(True)
    assert seen and all(seen)  # every block forward of the merged model ran the lean activation
    seen.clear()
    own = calibrated(False)
    assert seen and not any(seen)
    for name, value in own.items():
        assert torch.equal(lean[name], value), name
