"""`_kernels.finite.all_finite`: the one-pass NaN/Inf check agrees with torch's entry-wise test, also
where the sum overflows or cancels."""

from __future__ import annotations

import pytest
import torch

from hf_featcal._kernels.finite import all_finite

BIG = torch.finfo(torch.float32).max


@pytest.mark.parametrize(
    "values",
    [
        [1.0, -2.0, 3.5],
        [],
        [float("nan")],
        [1.0, float("inf"), 2.0],
        [-float("inf"), 1.0],
        [float("inf"), -float("inf")],  # the sum cancels to NaN
        [BIG, BIG, BIG],  # finite entries whose sum overflows: the entry-wise test decides
        [BIG, BIG, float("nan")],
        [-BIG, -BIG, 1.0],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_the_entrywise_test(values, dtype):
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)  # (BIG is ±inf in float16)
    want = bool(torch.isfinite(tensor).all())
    assert all_finite(tensor) is want
    assert all_finite(tensor.reshape(-1, 1).expand(-1, 3)) is want  # a strided view


def test_integer_and_bool_tensors_are_finite():
    assert all_finite(torch.tensor([1, 2**62], dtype=torch.int64))
    assert all_finite(torch.tensor([True, False]))


def test_a_nan_anywhere_in_a_large_matrix_is_found(generator):
    matrix = torch.randn(512, 384, generator=generator)
    assert all_finite(matrix)
    matrix[311, 17] = float("nan")
    assert not all_finite(matrix)
