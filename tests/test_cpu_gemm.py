"""The CPU's float32 GEMM library (`hf_featcal._kernels.gemm`): decided in one place (oneDNN on x86-64 CPUs
that are not Intel's and have AVX-512, MKL elsewhere, `HF_FEATCAL_CPU_GEMM` overriding; the Gram kernel:
syrk except on other vendors' x86-64 CPUs, `HF_FEATCAL_CPU_GRAM` overriding), oneDNN's Linear forward equal
to a float64 product to float32 precision, taken only for float32 CPU inputs without gradients or
autocast, undone on exit — and a calibration on either library equal to the other to rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_featcal import FeatCalCalibrator
from hf_featcal._kernels import gemm
from hf_featcal._kernels.gemm import (
    GEMM_LIBRARY_VARIABLE,
    GRAM_KERNEL_VARIABLE,
    gemm_library,
    gram_kernel,
    linear_product,
    onednn_linear,
    onednn_linears,
)
from testing_utils import assert_same_up_to_rounding

needs_onednn = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch has no oneDNN inner product")


@pytest.fixture
def counted(monkeypatch):
    """Counts the products handed to oneDNN (`onednn_linears`' forwards, `linear_product`)."""
    calls = []
    real = gemm.onednn_linear
    monkeypatch.setattr(gemm, "onednn_linear", lambda x, w, b: calls.append(tuple(x.shape)) or real(x, w, b))
    return calls


ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
ZEN3 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(
    "machine, vendor, flags, forced, want",
    [
        ("x86_64", "AuthenticAMD", ZEN4, None, "onednn"),
        ("x86_64", "AuthenticAMD", ZEN3, None, "mkl"),  # MKL's AVX2 kernels are the faster ones there
        ("x86_64", "HygonGenuine", ZEN4, None, "onednn"),
        ("x86_64", "GenuineIntel", ZEN4, None, "mkl"),
        ("x86_64", None, ZEN4, None, "mkl"),  # vendor unknown: torch's own choice
        ("aarch64", "ARM", frozenset(), None, "mkl"),
        ("x86_64", "GenuineIntel", ZEN3, "onednn", "onednn"),
        ("x86_64", "AuthenticAMD", ZEN4, " MKL ", "mkl"),
    ],
)
def test_one_place_decides_the_library(monkeypatch, machine, vendor, flags, forced, want):
    _pretend(monkeypatch, machine, vendor, GEMM_LIBRARY_VARIABLE, forced)
    monkeypatch.setattr(gemm, "cpu_flags", lambda: flags)
    monkeypatch.setattr(gemm, "onednn_available", lambda: True)
    assert gemm_library() == want


def _pretend(monkeypatch, machine, vendor, variable, forced):
    """This process on another CPU, with `variable` set to `forced` (None: unset)."""
    monkeypatch.setattr(gemm.platform, "machine", lambda: machine)
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    if forced is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, forced)


@pytest.mark.parametrize(
    "machine, vendor, forced, want",
    [
        ("x86_64", "GenuineIntel", None, "syrk"),
        ("x86_64", "AuthenticAMD", None, "blocked"),  # MKL's syrk is not tuned for other vendors' CPUs
        ("x86_64", None, None, "syrk"),
        ("aarch64", "ARM", None, "syrk"),
        ("x86_64", "AuthenticAMD", " SYRK", "syrk"),
        ("x86_64", "GenuineIntel", "blocked", "blocked"),
    ],
)
def test_one_place_decides_the_gram_kernel(monkeypatch, machine, vendor, forced, want):
    _pretend(monkeypatch, machine, vendor, GRAM_KERNEL_VARIABLE, forced)
    assert gram_kernel() == want
    monkeypatch.setenv(GRAM_KERNEL_VARIABLE, "potrf")
    with pytest.raises(ValueError, match=f"{GRAM_KERNEL_VARIABLE} must be one of"):
        gram_kernel()


@pytest.mark.parametrize("kernel", ["syrk", "blocked"])
def test_the_gram_takes_the_chosen_kernel(monkeypatch, kernel):
    """`add_upper_gram` of unit-weight rows calls syrk exactly where it is the choice, and either
    kernel gives the Gram's upper triangle of a float64 product."""
    from hf_featcal._kernels import gram as gram_module

    calls = []
    real = gram_module.syrk_upper_
    monkeypatch.setattr(gram_module, "syrk_upper_", lambda out, a: calls.append(a.shape) or real(out, a))
    monkeypatch.setenv(GRAM_KERNEL_VARIABLE, kernel)
    x = torch.randn(300, 640, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    upper = torch.zeros(640, 640, dtype=torch.float64)
    gram_module.add_upper_gram(upper, x, x)
    gram_module.mirror_diagonal_blocks_(upper)
    assert len(calls) == (1 if kernel == "syrk" else 0)
    torch.testing.assert_close(gram_module.symmetric_from_upper(upper), x.T @ x, rtol=1e-12, atol=1e-10)


def test_without_onednn_the_choice_is_mkl_and_forcing_it_is_refused(monkeypatch):
    monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(gemm, "onednn_available", lambda: False)
    monkeypatch.delenv(GEMM_LIBRARY_VARIABLE, raising=False)
    assert gemm_library() == "mkl"
    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "onednn")
    with pytest.raises(RuntimeError, match=GEMM_LIBRARY_VARIABLE):
        gemm_library()
    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "blis")
    with pytest.raises(ValueError, match=f"{GEMM_LIBRARY_VARIABLE} must be one of"):
        gemm_library()


def test_the_vendor_is_read_from_cpuinfo():
    vendor = gemm.cpu_vendor()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert vendor is None
        return
    lines = [line for line in text.splitlines() if line.split(":", 1)[0].strip() == "vendor_id"]
    assert vendor == (lines[0].split(":", 1)[1].strip() if lines else None)


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("transposed_weight", [False, True])
def test_onednn_linear_is_a_float32_product(generator, shape, with_bias, transposed_weight):
    x = torch.randn(*shape, generator=generator)
    weight = (
        torch.randn(24, 40, generator=generator).T if transposed_weight else torch.randn(40, 24, generator=generator)
    )
    bias = torch.randn(40, generator=generator) if with_bias else None
    got = onednn_linear(x, weight, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 40)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@needs_onednn
def test_linears_run_on_onednn_only_where_they_may(generator, monkeypatch, counted):
    """Float32 CPU inputs without gradients take oneDNN; gradients, another dtype or autocast take
    the module's own forward; a subclass with its own forward, or a forward set on the instance, is
    left alone; hooks still fire; everything is undone on exit, also on error."""

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "onednn")
    plain, scaled, other = torch.nn.Linear(12, 6), Scaled(12, 6), torch.nn.Linear(12, 6)
    wide = torch.nn.Linear(12, 6, bias=False).double()  # (no bias: the dtype test alone decides)
    root = torch.nn.ModuleDict({"plain": plain, "scaled": scaled, "other": other, "wide": wide})
    own_forward = lambda x: torch.zeros(1)  # noqa: E731 (someone else's instance forward)
    other.forward = own_forward
    seen = []
    plain.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    x = torch.randn(4, 12, generator=generator)
    with onednn_linears(root):
        assert "forward" in plain.__dict__ and "forward" not in scaled.__dict__ and other.forward is own_forward
        with torch.no_grad():
            out = plain(x)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, plain.weight, plain.bias))
            assert counted == [(4, 12)] and seen == [(4, 12)]
            scaled(x)
            strided = torch.randn(12, 4, generator=generator).T  # oneDNN is slow on strided operands: Linear's own
            assert torch.equal(plain(strided), torch.nn.functional.linear(strided, plain.weight, plain.bias))
            x64 = x.double()  # float64: Linear's own forward, bit for bit
            assert "forward" in wide.__dict__ and torch.equal(wide(x64),
                                                              torch.nn.functional.linear(x64, wide.weight, wide.bias))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert plain(x).dtype == torch.bfloat16  # autocast's own path
        with_grad = plain(x)  # gradients on: Linear's own forward, and backward works
        assert with_grad.requires_grad and torch.equal(with_grad,
                                                       torch.nn.functional.linear(x, plain.weight, plain.bias))
        with_grad.sum().backward()
        assert plain.weight.grad is not None
        assert counted == [(4, 12)]
    assert "forward" not in plain.__dict__ and other.forward is own_forward
    with pytest.raises(KeyError), onednn_linears(root):
        assert "forward" in plain.__dict__
        raise KeyError("inside")
    assert "forward" not in plain.__dict__


@needs_onednn
def test_linear_product_takes_the_chosen_library(generator, monkeypatch, counted):
    x = torch.randn(9, 24, generator=generator)
    weight = torch.randn(5, 24, generator=generator)
    want = x.double() @ weight.double().T
    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "onednn")
    got = linear_product(x, weight)
    assert counted == [(9, 24)] and float((got.double() - want).norm() / want.norm()) < 1e-6
    strided = x.T.contiguous().T  # the same values, column-major: torch's product
    assert torch.equal(linear_product(strided, weight), torch.mm(strided, weight.T)) and len(counted) == 1
    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "mkl")
    assert torch.equal(linear_product(x, weight), torch.mm(x, weight.T)) and len(counted) == 1


def test_nothing_is_patched_when_the_choice_is_mkl(monkeypatch, counted):
    monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, "mkl")
    linear = torch.nn.Linear(4, 3)
    with onednn_linears(linear), torch.no_grad():
        assert "forward" not in linear.__dict__
        linear(torch.randn(2, 4))
    assert counted == []


@needs_onednn
def test_a_calibration_on_onednn_equals_one_on_mkl_to_rounding(clip_setting, monkeypatch, counted):
    base, experts, merged, data = clip_setting
    results = {}
    for library in ("mkl", "onednn"):
        monkeypatch.setenv(GEMM_LIBRARY_VARIABLE, library)
        model = copy.deepcopy(merged)
        FeatCalCalibrator(model, base, experts, data, show_progress=False).calibrate()
        results[library] = model.state_dict()
        assert (len(counted) > 0) == (library == "onednn")  # forwards and fc2's projections, and only there
    assert_same_up_to_rounding(results["onednn"], results["mkl"])
    moved = max(float((results["onednn"][k] - merged.state_dict()[k]).abs().max()) for k in results["mkl"])
    assert moved > 1e-3  # the calibration did change the model


FLOAT32, ROUNDED = gemm.FLOAT32_RESULTS, gemm.ROUNDED_RESULTS


@pytest.mark.parametrize(
    "flags, dtype, device, want",
    [
        ({"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16, "cpu", FLOAT32),
        ({"avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}, torch.bfloat16, "cpu", FLOAT32),  # a Sapphire Rapids
        ({"avx512f", "amx_bf16", "amx_tile"}, torch.float16, "cpu", None),  # AMX without its fp16 unit
        ({"avx512f", "amx_bf16", "amx_fp16"}, torch.float16, "cpu", FLOAT32),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16, "cpu", ROUNDED),  # an AMD EPYC (Zen 4): no matrix unit
        ({"avx512f", "avx512_bf16"}, torch.float16, "cpu", None),
        ({"avx512f", "avx2"}, torch.bfloat16, "cpu", None),
        (set(), torch.bfloat16, "cpu", None),
        (set(), torch.bfloat16, "cuda", FLOAT32),  # tensor cores
    ],
)
def test_low_precision_products_by_matrix_unit_and_dot_products(monkeypatch, flags, dtype, device, want):
    monkeypatch.setattr(gemm, "cpu_flags", lambda: frozenset(flags))
    assert gemm.low_precision_products(dtype, torch.device(device)) == want
    assert gemm.low_precision_products_pay(dtype, torch.device(device)) is (want is not None)


def test_no_rounded_products_without_onednn(monkeypatch):
    # torch's bf16 product runs on oneDNN; without it, float32 products are the faster ones
    monkeypatch.setattr(gemm, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert gemm.low_precision_products(torch.bfloat16, torch.device("cpu")) is None


def test_the_flags_are_read_from_cpuinfo():
    flags = gemm.cpu_flags()
    try:
        lines = [line for line in open("/proc/cpuinfo") if line.startswith("flags")]
    except OSError:
        assert flags == frozenset()
        return
    assert not lines or flags == frozenset(lines[0].split(":", 1)[1].split())


@pytest.mark.parametrize("variable", [GEMM_LIBRARY_VARIABLE, GRAM_KERNEL_VARIABLE])
def test_a_bad_library_variable_is_refused_before_any_work(clip_setting, monkeypatch, variable):
    base, experts, merged, data = clip_setting
    before = copy.deepcopy(merged.state_dict())
    monkeypatch.setenv(variable, "blis")
    with pytest.raises(ValueError, match=f"{variable} must be one of"):
        FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    assert all(torch.equal(v, before[k]) for k, v in merged.state_dict().items())
