"""Products of bfloat16 (or float16) factors with float32 results on the CPU, for fast mode's statistics.

torch has no CPU kernel for `torch.mm(a, b, out_dtype=torch.float32)`: a low-precision product
comes out rounded to the low dtype. The MKL that torch's CPU library carries has one:
`cblas_gemm_bf16bf16f32` (and `cblas_gemm_f16f16f32`) multiplies low-precision factors, sums in
float32 and adds the result into a float32 matrix, in place and without a temporary. The kernel is
looked up once in torch's own `libtorch_cpu`; where it is missing (a build without MKL, another
platform), `addmm_low_` does nothing and says so, and callers take torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

_ROW_MAJOR, _NO_TRANSPOSE, _TRANSPOSE = 101, 111, 112  # CBLAS enums
_KERNELS = {torch.bfloat16: "cblas_gemm_bf16bf16f32", torch.float16: "cblas_gemm_f16f16f32"}
_INT_MAX = 2**31 - 1  # MKL's LP64 integers


@functools.cache
def _kernel(dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """MKL's mixed-precision GEMM for factors of `dtype`, from torch's CPU library (None if absent)."""
    name = _KERNELS.get(dtype)
    if name is None:
        return None
    try:
        function = getattr(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")), name)
    except (OSError, AttributeError):
        return None
    integer, pointer, real = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    function.restype = None
    function.argtypes = [integer] * 6 + [real, pointer, integer, pointer, integer, real, pointer, integer]
    return function if _answers_right(function, dtype) else None


def _answers_right(function: ctypes._CFuncPtr, dtype: torch.dtype) -> bool:
    """One small product with an exact answer (small integers, exact in every dtype here): a kernel
    with another calling convention than the one declared (e.g. 64-bit integers) is not used."""
    a = torch.arange(1.0, 7.0).reshape(2, 3)
    b = torch.arange(-4.0, 8.0).reshape(3, 4)
    out = torch.ones(2, 4)
    low_a, low_b = a.to(dtype), b.to(dtype)
    function(_ROW_MAJOR, _NO_TRANSPOSE, _NO_TRANSPOSE, 2, 4, 3, 1.0, low_a.data_ptr(), 3, low_b.data_ptr(), 4, 2.0,
             out.data_ptr(), 4)
    return torch.equal(out, a @ b + 2.0)


def available(dtype: torch.dtype) -> bool:
    """Whether `addmm_low_` can multiply factors of `dtype` on this machine."""
    return _kernel(dtype) is not None


def _blas_layout(matrix: Tensor) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a 2-D strided matrix as a row-major BLAS operand,
    or None when neither it nor its transpose has unit stride along a row."""
    rows, cols = matrix.shape
    if matrix.stride(1) == 1 and matrix.stride(0) >= max(1, cols):
        return _NO_TRANSPOSE, matrix.stride(0)
    if matrix.stride(0) == 1 and matrix.stride(1) >= max(1, rows):
        return _TRANSPOSE, matrix.stride(1)
    return None


def addmm_low_(out: Tensor, a: Tensor, b: Tensor, beta: float = 1.0) -> bool:
    """out ← beta·out + a @ b for CPU factors `a` (m×k) and `b` (k×n) of one low dtype (bfloat16 or
    float16) and a float32 `out` (m×n, rows of unit stride, e.g. a block of a larger matrix), by
    MKL, summing in float32. With beta = 0 out's old values are not read (NaN in it stays out).

    Returns False, with `out` untouched, where the kernel or this operand layout is not available;
    the caller then computes the product otherwise."""
    if not (a.dim() == b.dim() == out.dim() == 2 and a.dtype == b.dtype and out.dtype == torch.float32):
        return False
    if not (a.device.type == b.device.type == out.device.type == "cpu"):
        return False
    kernel = _kernel(a.dtype)
    (m, k), (k2, n) = a.shape, b.shape
    if kernel is None or k2 != k or tuple(out.shape) != (m, n) or min(m, n, k) == 0 or max(m, n, k) > _INT_MAX:
        return False
    if out.stride(1) != 1 or out.stride(0) < max(1, n) or out.stride(0) > _INT_MAX:
        return False
    a = a if _blas_layout(a) is not None else a.contiguous()
    b = b if _blas_layout(b) is not None else b.contiguous()
    (transpose_a, lda), (transpose_b, ldb) = _blas_layout(a), _blas_layout(b)
    if max(lda, ldb) > _INT_MAX:
        return False
    kernel(
        _ROW_MAJOR, transpose_a, transpose_b, m, n, k, 1.0, a.data_ptr(), lda, b.data_ptr(), ldb, float(beta),
        out.data_ptr(), out.stride(0),
    )
    return True
