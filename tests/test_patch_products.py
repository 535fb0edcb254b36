"""Patch embeddings as one product (`_kernels.convolutions`): the same function as torch's
convolution, checked against float64 convolutions; the modules it may take, and only those; and a
calibration whose streams enter through it, against one through the convolutions themselves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_featcal import FeatCalCalibrator
from hf_featcal._kernels import convolutions
from hf_featcal._kernels.convolutions import is_patch_convolution, patch_product, patch_products
from testing_utils import assert_same_up_to_rounding


@pytest.fixture
def counted(monkeypatch):
    """The inputs `patch_product` was called on, in order."""
    calls: list[tuple[int, ...]] = []
    real = convolutions.patch_product

    def counting(x, weight, bias):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(convolutions, "patch_product", counting)
    return calls


@pytest.mark.parametrize(
    "image, kernel, with_bias",
    [
        ((2, 3, 32, 32), (8, 8), False),  # patches tile the image
        ((3, 3, 37, 42), (8, 8), True),  # rows and columns past the last whole patch, left out
        ((1, 4, 12, 30), (4, 6), True),  # a rectangular kernel
        ((2, 1, 5, 5), (5, 5), False),  # one patch
    ],
)
def test_the_product_is_the_convolution(generator, image, kernel, with_bias):
    x = torch.randn(image, generator=generator, dtype=torch.float64)
    weight = torch.randn(7, image[1], *kernel, generator=generator, dtype=torch.float64)
    bias = torch.randn(7, generator=generator, dtype=torch.float64) if with_bias else None
    want = F.conv2d(x, weight, bias, stride=kernel)
    got = patch_product(x, weight, bias)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # in float32 the terms are summed in another order: equal to the float64 convolution to rounding
    got32 = patch_product(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "conv, patch",
    [
        (dict(kernel_size=4, stride=4), True),
        (dict(kernel_size=(2, 3), stride=(2, 3), bias=False), True),
        (dict(kernel_size=4, stride=4, padding="valid"), True),
        (dict(kernel_size=4, stride=2), False),  # overlapping windows
        (dict(kernel_size=4, stride=4, padding=1), False),
        (dict(kernel_size=3, stride=3, dilation=2), False),
    ],
)
def test_only_convolutions_whose_windows_tile_the_input_are_taken(conv, patch):
    assert is_patch_convolution(nn.Conv2d(3, 6, **conv)) is patch
    assert is_patch_convolution(nn.Conv2d(4, 6, groups=2, kernel_size=2, stride=2)) is False
    assert is_patch_convolution(nn.Conv1d(3, 6, kernel_size=2, stride=2)) is False

    class OwnForward(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    assert is_patch_convolution(OwnForward(3, 6, kernel_size=4, stride=4)) is False


def test_the_module_runs_its_own_forward_where_the_product_may_not(generator, counted):
    model = nn.Sequential(nn.Conv2d(3, 5, kernel_size=4, stride=4), nn.Conv2d(5, 5, kernel_size=3, padding=1))
    x = torch.randn(2, 3, 16, 16, generator=generator)
    with torch.no_grad():
        want = model(x)
        with patch_products(model):
            got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert counted == [(2, 3, 16, 16)]  # the first convolution only

    counted.clear()
    with patch_products(model):
        model(x).sum().backward()  # gradients to record: the convolutions' own forwards, which torch differentiates
        assert model[0].weight.grad is not None
        with torch.no_grad():
            model.double()(x.double())  # float64: the convolution's own kernel
            model.float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)  # autocast casts the convolution's operands: its own forward
            with pytest.raises(RuntimeError):
                model(x[:, :, :3, :3])  # smaller than one patch: the convolution's own error
    assert counted == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_forward_is_back_after_an_error_and_patched_forwards_are_left_alone(generator):
    conv = nn.Conv2d(3, 4, kernel_size=2, stride=2)
    own = lambda x: x  # noqa: E731 - stands for a hook's or another patch's forward
    hooked = nn.Conv2d(3, 4, kernel_size=2, stride=2)
    hooked.forward = own
    with pytest.raises(RuntimeError, match="boom"), patch_products(nn.ModuleList([conv, hooked])):
        assert "forward" in conv.__dict__
        raise RuntimeError("boom")
    assert "forward" not in conv.__dict__
    assert hooked.forward is own


def test_a_calibration_entering_by_products_equals_one_by_convolutions(clip_setting, monkeypatch, counted):
    base, experts, merged, data = clip_setting
    results = {}
    for way in ("product", "convolution"):
        if way == "convolution":
            monkeypatch.setattr(convolutions, "is_patch_convolution", lambda module: False)
        counted.clear()
        model = copy.deepcopy(merged)
        FeatCalCalibrator(model, base, experts, data, show_progress=False).calibrate()
        results[way] = model.state_dict()
        # every batch through the merged model's input path and through its task's expert's, once
        assert len(counted) == (2 * sum(len(batches) for batches in data.values()) if way == "product" else 0)
        assert all("forward" not in m.__dict__ for m in model.modules())
    assert_same_up_to_rounding(results["product"], results["convolution"])
    moved = max(float((results["product"][k] - merged.state_dict()[k]).abs().max()) for k in results["product"])
    assert moved > 1e-3  # the calibration did change the model
