"""Products torch has no CPU kernel for, from the MKL inside torch's own CPU library.

- **Low-precision factors, float32 results** (fast mode's statistics): torch has no CPU kernel for
  `torch.mm(a, b, out_dtype=torch.float32)`, a low-precision product comes out rounded to the low
  dtype. MKL's `cblas_gemm_bf16bf16f32` (and `cblas_gemm_f16f16f32`) multiplies low-precision
  factors, sums in float32 and adds the result into a float32 matrix, in place (`addmm_low_`).
- **A Gram's upper triangle** (exact mode's statistics): torch computes aᵀa as a full product.
  MKL's syrk computes only the upper triangle, with half the arithmetic (`syrk_upper_`).

Each kernel is looked up once in torch's `libtorch_cpu` and checked on one small product with an
exact answer; where it is missing or answers wrong (a build without MKL, another platform, another
calling convention), the function does nothing and says so, and callers take torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

_ROW_MAJOR, _NO_TRANSPOSE, _TRANSPOSE = 101, 111, 112  # CBLAS enums
_KERNELS = {torch.bfloat16: "cblas_gemm_bf16bf16f32", torch.float16: "cblas_gemm_f16f16f32"}
#: MKL's syrk by dtype. torch's library exports neither `cblas_ssyrk` nor `ssyrk_`, only MKL's own
#: entry behind them, with the Fortran interface (column-major, every argument by reference); the
#: first-use probe guards against another convention in another build
_SYRK_KERNELS = {torch.float32: ("mkl_blas_ssyrk", ctypes.c_float), torch.float64: ("mkl_blas_dsyrk", ctypes.c_double)}
_INT_MAX = 2**31 - 1  # MKL's LP64 integers


def _torch_cpu_symbol(name: str) -> ctypes._CFuncPtr | None:
    """A function of torch's CPU library by name (None where the library or the symbol is missing)."""
    try:
        return getattr(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _kernel(dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """MKL's mixed-precision GEMM for factors of `dtype`, from torch's CPU library (None if absent)."""
    name = _KERNELS.get(dtype)
    function = None if name is None else _torch_cpu_symbol(name)
    if function is None:
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


@functools.cache
def _syrk_kernel(dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    """MKL's syrk for `dtype` (float32, float64), from torch's CPU library (None if absent or wrong)."""
    name, _ = _SYRK_KERNELS.get(dtype, (None, None))
    function = None if name is None else _torch_cpu_symbol(name)
    if function is None:
        return None
    function.restype = None
    function.argtypes = [ctypes.c_char_p, ctypes.c_char_p] + [ctypes.c_void_p] * 8
    return function if _syrk_answers_right(function, dtype) else None


def _call_syrk(
    function: ctypes._CFuncPtr, dtype: torch.dtype, out: Tensor, a: Tensor, beta: float, layout: tuple[int, int]
) -> None:
    """out's upper triangle ← beta·out + aᵀa, for `a`'s `_blas_layout`. Row-major `out` read
    column-major is its transpose, so its upper triangle is the column-major lower one ("L"); a
    row-major `a` (m×n) is the column-major n×m matrix aᵀ, so C = aᵀ(aᵀ)ᵀ ("N"); a column-major one
    is `a` itself ("T": C = aᵀa)."""
    real = _SYRK_KERNELS[dtype][1]
    m, n = a.shape
    transpose, lda = layout

    def integer(value: int) -> ctypes._CArgObject:
        return ctypes.byref(ctypes.c_int(value))

    function(
        b"L", b"N" if transpose == _NO_TRANSPOSE else b"T", integer(n), integer(m), ctypes.byref(real(1.0)),
        ctypes.c_void_p(a.data_ptr()), integer(lda), ctypes.byref(real(beta)), ctypes.c_void_p(out.data_ptr()),
        integer(out.stride(0)),
    )


def _syrk_answers_right(function: ctypes._CFuncPtr, dtype: torch.dtype) -> bool:
    """One small Gram with an exact answer: the upper triangle is aᵀa + 2·out, the part below it untouched."""
    a = torch.arange(-3.0, 9.0, dtype=dtype).reshape(4, 3)
    out = torch.ones(3, 3, dtype=dtype)
    _call_syrk(function, dtype, out, a, 2.0, _blas_layout(a))
    expected = (a.T @ a + 2.0).triu() + torch.ones(3, 3, dtype=dtype).tril(-1)
    return torch.equal(out, expected)


def syrk_available(dtype: torch.dtype) -> bool:
    """Whether `syrk_upper_` can compute Grams of `dtype` on this machine."""
    return _syrk_kernel(dtype) is not None


def syrk_upper_(out: Tensor, a: Tensor, beta: float = 1.0) -> bool:
    """The upper triangle of `out` (n×n, rows of unit stride) ← beta·out + aᵀa for a CPU matrix `a`
    (m×n) of out's dtype (float32 or float64), by MKL's syrk: d²·m multiply-adds instead of a
    product's 2·d²·m. The part below the diagonal is neither read nor written. With beta = 0 the
    triangle's old values are not read.

    Returns False, with `out` untouched, where the kernel or this operand layout is not available;
    the caller then computes the Gram otherwise."""
    if not (a.dim() == out.dim() == 2 and a.dtype == out.dtype and a.device.type == out.device.type == "cpu"):
        return False
    kernel = _syrk_kernel(a.dtype)
    (m, n) = a.shape
    if kernel is None or tuple(out.shape) != (n, n) or min(m, n) == 0 or max(m, n) > _INT_MAX:
        return False
    if out.stride(1) != 1 or not max(1, n) <= out.stride(0) <= _INT_MAX:
        return False
    layout = _blas_layout(a)
    if layout is None or layout[1] > _INT_MAX:
        return False
    _call_syrk(kernel, a.dtype, out, a, beta, layout)
    return True
