"""`hf_featcal._kernels.mkl_products`: low-precision factors, float32 results (MKL's mixed GEMM on the CPU),
checked against float64 products of the same low-precision factors; a Gram's upper triangle (MKL's
syrk), checked against float64 products."""

from __future__ import annotations

import pytest
import torch

from hf_featcal._kernels import gemm, gram, mkl_products
from hf_featcal._kernels.mkl_products import addmm_low_, available, syrk_available, syrk_upper_

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
LOW_DTYPES = [torch.bfloat16, pytest.param(torch.float16, id="float16")]


def _reference(out_before, a, b, beta):
    """beta·out + a @ b in float64 (the low-precision factors are exact in float64)."""
    product = a.double() @ b.double()
    return product if beta == 0.0 else beta * out_before.double() + product


def _relative(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@needs_mkl
def test_the_bfloat16_kernel_is_found_in_torchs_library():
    # fast mode's CPU statistics rely on it; without it they fall back to products rounded to bfloat16
    assert available(torch.bfloat16)
    assert not available(torch.float32)


@needs_mkl
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("layout",
                         ["plain", "a transposed", "b transposed", "both transposed", "block of out", "strided rows"])
@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_addmm_low_equals_the_float64_product(generator, dtype, layout, beta):
    if not available(dtype):
        pytest.skip(f"no MKL kernel for {dtype}")
    m, k, n = 37, 203, 29
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    if layout in ("a transposed", "both transposed"):
        a = a.T.contiguous().T  # column-major storage: a transposed operand for BLAS
    if layout in ("b transposed", "both transposed"):
        b = b.T.contiguous().T
    if layout == "strided rows":
        a = torch.randn(m, 2 * k, generator=generator).to(dtype)[:, ::2]  # neither stride is 1: copied first
        b = torch.randn(2 * k, n, generator=generator).to(dtype)[::2]  # rows of stride 2n
    big = torch.randn(m + 5, n + 11, generator=generator)
    out = big[3 : 3 + m, 7 : 7 + n] if layout == "block of out" else torch.randn(m, n, generator=generator)
    if beta == 0.0:
        out.fill_(float("nan"))  # beta = 0: the old values are not read
    before, big_before = out.clone(), big.clone()
    assert addmm_low_(out, a, b, beta=beta)
    reference = _reference(before, a, b, beta)
    assert torch.isfinite(out).all()
    assert _relative(out, reference) < 1e-6  # float32 sums; a bfloat16-rounded result is ~1e-3 off
    if layout == "block of out":  # nothing outside the block is written
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[3 : 3 + m, 7 : 7 + n] = False
        assert torch.equal(big[mask], big_before[mask])


@needs_mkl
def test_accumulation_over_batches_stays_in_float32(generator):
    """Many small products added into one float32 sum: the sum keeps float32 precision (a product
    rounded to bfloat16 before each addition would carry ~2⁻⁹ of relative error)."""
    total = torch.zeros(48, 48)
    reference = torch.zeros(48, 48, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(64, 48, generator=generator).bfloat16()
        assert addmm_low_(total, x.T, x)
        reference += x.double().T @ x.double()
    assert _relative(total, reference) < 1e-6


@pytest.mark.parametrize(
    "case",
    ["float32 factors", "mixed factors", "float64 out", "transposed out", "empty contraction", "shape mismatch",
     "vector"],
)
def test_refused_operands_leave_out_untouched(generator, case):
    a = torch.randn(6, 5, generator=generator).bfloat16()
    b = torch.randn(5, 4, generator=generator).bfloat16()
    out = torch.randn(6, 4, generator=generator)
    if case == "float32 factors":
        a, b = a.float(), b.float()
    elif case == "mixed factors":
        b = b.half()
    elif case == "float64 out":
        out = out.double()
    elif case == "transposed out":
        out = torch.randn(4, 6, generator=generator).T
    elif case == "empty contraction":
        a, b = a[:, :0], b[:0]
    elif case == "shape mismatch":
        b = torch.randn(4, 4, generator=generator).bfloat16()
    elif case == "vector":
        b = b[:, 0]
    before = out.clone()
    assert not addmm_low_(out, a, b)
    assert torch.equal(out, before)


def test_a_kernel_giving_wrong_answers_is_not_used(monkeypatch):
    """The first-use probe: a kernel whose products are wrong (another calling convention) is dropped."""
    calls = []

    def wrong(*args):
        calls.append(args)  # writes nothing: `out` keeps its ones, not the product

    assert not mkl_products._answers_right(wrong, torch.bfloat16)
    assert calls
    if torch.backends.mkl.is_available():
        assert mkl_products._answers_right(mkl_products._kernel(torch.bfloat16), torch.bfloat16)


def test_without_the_kernel_nothing_is_done(generator, monkeypatch):
    monkeypatch.setattr(mkl_products, "_kernel", lambda dtype: None)
    out = torch.zeros(3, 3)
    assert not addmm_low_(out, torch.ones(3, 2).bfloat16(), torch.ones(2, 3).bfloat16())
    assert torch.equal(out, torch.zeros(3, 3))


def _product_factors(generator):
    """Float32 factors a (300×40), b (300×24) of aᵀb, their bfloat16 values and aᵀb of those in float64."""
    a = torch.randn(300, 40, generator=generator)
    b = torch.randn(300, 24, generator=generator)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return a, b, a16, b16, a16.double().T @ b16.double()


@needs_mkl
def test_fast_mode_products_come_out_in_float32(generator, monkeypatch):
    """`gram.product` in fast mode on a CPU whose low-precision products give float32 results
    (AMX, stubbed here): float32 results of the bfloat16 factors, new or added into the sums; without
    the kernel, torch's products rounded to bfloat16 (the fallback)."""
    monkeypatch.setattr(gram, "low_precision_products", lambda dtype, device: gemm.FLOAT32_RESULTS)
    a, b, a16, b16, reference = _product_factors(generator)
    new = gram.product(a.T, b, torch.bfloat16)
    assert new.dtype == torch.float32
    assert _relative(new, reference) < 1e-6
    acc = torch.ones(40, 24)
    gram.product(a.T, b, torch.bfloat16, out=acc)
    assert _relative(acc, reference + 1.0) < 1e-6

    monkeypatch.setattr(gram, "addmm_low_", lambda *args, **kwargs: False)
    fallback = gram.product(a.T, b, torch.bfloat16)
    assert fallback.dtype == torch.float32
    assert 1e-4 < _relative(fallback, reference) < 1e-2  # rounded to bfloat16 once


def test_products_rounded_where_torchs_own_low_precision_product_is_the_faster(generator, monkeypatch):
    """Where `gemm.low_precision_products` is `ROUNDED_RESULTS` (AVX-512 BF16 without AMX, stubbed
    here), `gram.product` leaves MKL's mixed GEMM alone and takes torch's bfloat16 product: the
    bfloat16 factors' product rounded to bfloat16 once, in float32, new or added into the sums."""
    monkeypatch.setattr(gram, "low_precision_products", lambda dtype, device: gemm.ROUNDED_RESULTS)
    called = []
    monkeypatch.setattr(gram, "addmm_low_", lambda *args, **kwargs: called.append(args) or False)
    a, b, a16, b16, reference = _product_factors(generator)
    new = gram.product(a.T, b, torch.bfloat16)
    assert new.dtype == torch.float32
    assert torch.equal(new, torch.mm(a16.T, b16).float())
    assert 1e-4 < _relative(new, reference) < 1e-2  # rounded to bfloat16 once
    acc = torch.ones(40, 24)
    assert gram.product(a.T, b, torch.bfloat16, out=acc) is acc
    assert torch.equal(acc, torch.mm(a16.T, b16).float() + 1.0)
    assert called == []


# ---------------------------------------------------------------------------- syrk
@needs_mkl
def test_the_syrk_kernels_are_found_in_torchs_library():
    # exact mode's CPU Grams use them; without them they fall back to the blocked products
    assert syrk_available(torch.float32) and syrk_available(torch.float64)
    assert not syrk_available(torch.bfloat16)


@needs_mkl
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["plain", "a transposed", "block of out"])
@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_syrk_upper_is_the_upper_triangle_of_the_gram(generator, dtype, layout, beta):
    m, n = 203, 37
    a = torch.randn(m, n, generator=generator, dtype=torch.float64).to(dtype)
    if layout == "a transposed":
        a = a.T.contiguous().T  # column-major storage
    big = torch.randn(n + 5, n + 11, generator=generator, dtype=torch.float64).to(dtype)
    out = big[3 : 3 + n, 7 : 7 + n] if layout == "block of out" else torch.randn(n, n, generator=generator, dtype=dtype)
    if beta == 0.0:
        out.triu_().add_(float("nan")).tril_(-1).add_(float("nan"))  # NaN everywhere: beta = 0 reads none of it
    before, big_before = out.clone(), big.clone()
    assert syrk_upper_(out, a, beta=beta)
    gram = a.double().T @ a.double()
    reference = gram if beta == 0.0 else gram + beta * before.double()
    upper = torch.ones(n, n, dtype=torch.bool).triu()
    assert torch.isfinite(out[upper]).all()
    assert _relative(out[upper], reference[upper]) < (1e-6 if dtype == torch.float32 else 1e-14)
    # the part below the diagonal is neither read nor written
    assert torch.equal(out[~upper].isnan(), before[~upper].isnan())
    assert torch.equal(out[~upper].nan_to_num(), before[~upper].nan_to_num())
    if layout == "block of out":
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[3 : 3 + n, 7 : 7 + n] = False
        assert torch.equal(big[mask], big_before[mask])


@pytest.mark.parametrize("case",
                         ["bfloat16", "mixed dtypes", "not square", "transposed out", "strided rows", "no rows",
                          "on meta"])
def test_refused_grams_leave_out_untouched(generator, case):
    a = torch.randn(9, 5, generator=generator)
    out = torch.randn(5, 5, generator=generator)
    if case == "bfloat16":
        a, out = a.bfloat16(), out.bfloat16()
    elif case == "mixed dtypes":
        a = a.double()
    elif case == "not square":
        out = torch.randn(5, 6, generator=generator)
    elif case == "transposed out":
        out = torch.randn(5, 5, generator=generator).T
    elif case == "strided rows":
        a = torch.randn(9, 10, generator=generator)[:, ::2]  # neither stride is 1
    elif case == "no rows":
        a = a[:0]
    elif case == "on meta":
        a = a.to("meta")
    before = out.clone()
    assert not syrk_upper_(out, a)
    assert torch.equal(out, before)


def test_a_syrk_giving_wrong_answers_is_not_used():
    """The first-use probe: a kernel that writes nothing, or the other triangle (a row-major /
    column-major mix-up), is dropped."""
    calls = []

    def nothing(*args):
        calls.append(args)

    assert not mkl_products._syrk_answers_right(nothing, torch.float32)
    assert calls
    if torch.backends.mkl.is_available():
        real = mkl_products._syrk_kernel(torch.float32)
        assert mkl_products._syrk_answers_right(real, torch.float32)
        assert not mkl_products._syrk_answers_right(lambda uplo, *rest: real(b"U", *rest), torch.float32)


def test_without_syrk_nothing_is_done(monkeypatch):
    monkeypatch.setattr(mkl_products, "_syrk_kernel", lambda dtype: None)
    out = torch.zeros(3, 3)
    assert not syrk_upper_(out, torch.ones(4, 3))
    assert torch.equal(out, torch.zeros(3, 3))
