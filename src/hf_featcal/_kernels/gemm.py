"""Which library runs FeatCal's float32 matrix products on the CPU: MKL (torch's own choice) or oneDNN.

torch multiplies float32 matrices on the CPU with MKL's sgemm. On an Intel CPU nothing here beats
it. On other x86-64 CPUs MKL does not run its fastest kernels, and oneDNN's float32 inner product —
the library behind torch's `mkldnn` operators, which picks its kernels by the CPU's instruction
sets rather than its vendor — is faster (measured in docs/scale.md, "The CPU kernels"). Both are
float32 products with float32 sums; their results differ by rounding only (the order of the sums).

`gemm_library()` is the one place that decides; the environment variable `HF_FEATCAL_CPU_GEMM`
(`mkl` or `onednn`) overrides it, for benchmarks and tests. `onednn_linears(root)` routes a block's
plain `nn.Linear`s through oneDNN while gradients are off, in float32, when the decision is oneDNN.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

#: Overrides `gemm_library()`'s choice: one of `GEMM_LIBRARIES`.
GEMM_LIBRARY_VARIABLE = "HF_FEATCAL_CPU_GEMM"
GEMM_LIBRARIES = ("mkl", "onednn")


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo, or None (no such line, not Linux)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str | None:
    """The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, ...), or None where it cannot be read."""
    return _cpuinfo("vendor_id")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`avx512f`, `amx_bf16`, ...); empty where they cannot be read."""
    return frozenset((_cpuinfo("flags") or "").split())


#: The CPU flag of the matrix unit that makes MKL's low-precision GEMM faster than its float32 one.
LOW_PRECISION_MATRIX_UNITS = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
#: The CPU flag of the vector dot-product instructions with which oneDNN's low-precision matmul (torch's
#: own bf16 `mm` on the CPU) runs ~2× its float32 products where there is no matrix unit for the dtype.
LOW_PRECISION_DOT_PRODUCTS = {torch.bfloat16: "avx512_bf16"}

#: `low_precision_products` kinds: products of low-precision factors that come out in float32, or
#: whose result (one batch's sum over tokens) is rounded to the low dtype once before it is added.
FLOAT32_RESULTS = "float32 results"
ROUNDED_RESULTS = "rounded results"


def low_precision_products(dtype: torch.dtype, device: torch.device) -> str | None:
    """How fast mode's statistics multiply factors of `dtype` on `device`, where that is faster than
    float32 products; None where it is not (they then take float32 products of the captured features,
    exact mode's kernels: syrk, oneDNN's projections).

    - `FLOAT32_RESULTS`: on an accelerator (tensor cores, `torch.mm(out_dtype=)`), and on a CPU with
      the matrix unit for `dtype` (AMX), where MKL's mixed-precision GEMM runs several times faster
      than float32 products.
    - `ROUNDED_RESULTS`: on a CPU with only the dot-product instructions for `dtype` (AVX-512 BF16:
      AMD Zen 4, Intel Cooper Lake). There MKL's mixed GEMM runs no faster than float32, but
      oneDNN's bf16 matmul takes about half float32's time. It gives its result in bf16 only: each
      batch's product is rounded once, then added to the float32 sums (the rounding fast mode's
      accuracy table measured). The timings are in docs/scale.md ("The CPU kernels")."""
    if device.type != "cpu":
        return FLOAT32_RESULTS
    flags = cpu_flags()
    if LOW_PRECISION_MATRIX_UNITS.get(dtype) in flags:
        return FLOAT32_RESULTS
    if LOW_PRECISION_DOT_PRODUCTS.get(dtype) in flags and torch.backends.mkldnn.is_available():
        return ROUNDED_RESULTS
    return None


def low_precision_products_pay(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether fast mode's statistics' products run faster with `dtype` factors than in float32
    (`low_precision_products` names how)."""
    return low_precision_products(dtype, device) is not None


def _linear_operator() -> Callable | None:
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def onednn_available() -> bool:
    """Whether torch's oneDNN inner product runs here and answers one product with an exact answer
    (small integers, exact in float32) right."""
    operator = _linear_operator()
    if operator is None:
        return False
    x = torch.arange(1.0, 7.0).reshape(2, 3)
    weight = torch.arange(-4.0, 8.0).reshape(4, 3)
    bias = torch.tensor([1.0, -2.0, 0.5, 3.0])
    try:
        return torch.equal(operator(x, weight, bias, "none", [], ""), x @ weight.T + bias)
    except RuntimeError:
        return False


def gemm_library() -> str:
    """"onednn" on an x86-64 CPU that is not Intel's (where oneDNN's float32 products are faster than
    MKL's), "mkl" elsewhere; `HF_FEATCAL_CPU_GEMM` overrides the choice."""
    forced = os.environ.get(GEMM_LIBRARY_VARIABLE, "").strip().lower()
    if forced:
        if forced not in GEMM_LIBRARIES:
            raise ValueError(f"{GEMM_LIBRARY_VARIABLE} must be one of {GEMM_LIBRARIES}, got {forced!r}.")
        if forced == "onednn" and not onednn_available():
            raise RuntimeError(f"{GEMM_LIBRARY_VARIABLE}=onednn, but this torch has no working oneDNN inner product.")
        return forced
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    vendor = cpu_vendor()
    return "onednn" if x86 and vendor is not None and vendor != "GenuineIntel" and onednn_available() else "mkl"


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x Wᵀ + b by oneDNN's float32 inner product (x: (..., in), W: (out, in)), as `F.linear`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _runs_on_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Contiguous float32 CPU operands, no gradient to record, no autocast: what `onednn_linear`
    takes fast (else torch's own product runs; oneDNN's has no backward). A strided operand would
    send oneDNN to a generic kernel that was measured hundreds of times slower."""
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return (
        not recording
        and not torch.is_autocast_enabled("cpu")
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == weight.device.type == "cpu"
        and x.dim() >= 2
        and x.numel() > 0
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def linear_product(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ for x (M, in) and W (out, in), by this CPU's float32 GEMM library (`gemm_library()`):
    oneDNN's inner product where that is the choice and the operands suit it (`_runs_on_onednn`),
    else `torch.mm`."""
    if gemm_library() == "onednn" and _runs_on_onednn(x, weight, None):
        return onednn_linear(x, weight, None)
    return torch.mm(x, weight.T)


def _onednn_forward(module: nn.Linear) -> Callable[[Tensor], Tensor]:
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        weight, bias = module.weight, module.bias
        return onednn_linear(x, weight, bias) if _runs_on_onednn(x, weight, bias) else own(x)

    return forward


@contextlib.contextmanager
def onednn_linears(root: nn.Module) -> Iterator[None]:
    """While active and `gemm_library()` is "onednn", every Linear in `root` whose class keeps
    `nn.Linear`'s forward computes float32 CPU inputs without gradients (and without autocast) by
    oneDNN (`onednn_linear`); other inputs run its own forward. Modules whose `forward` was already
    replaced on the instance (accelerate's hooks, another patch) are left alone. A no-op where the
    decision is MKL. The class's forward is back on exit, also on error."""
    patched: list[nn.Module] = []
    try:
        if gemm_library() == "onednn":
            for module in root.modules():
                if (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
                        and "forward" not in module.__dict__):
                    module.forward = _onednn_forward(module)  # an instance attribute shadows the method
                    patched.append(module)
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
