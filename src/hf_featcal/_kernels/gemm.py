"""Which library runs FeatCal's float32 matrix products on the CPU: MKL (torch's own choice) or oneDNN.

torch multiplies float32 matrices on the CPU with MKL's sgemm. On an Intel CPU nothing here beats
it. MKL picks its kernels by the CPU's vendor: on other x86-64 CPUs it does not run its AVX-512
kernels, and where such a CPU has AVX-512 (AMD Zen 4) oneDNN's float32 inner product — the library
behind torch's `mkldnn` operators, which picks its kernels by the instruction sets — is faster. On
one whose widest vectors are AVX2 (AMD Zen 3) MKL's AVX2 kernels are the faster ones (measured in
docs/scale.md, "The CPU kernels"). Both are float32 products with float32 sums; their results differ
by rounding only (the order of the sums).

MKL's syrk (a Gram's upper triangle at half a product's arithmetic, `mkl_products.syrk_upper_`) is
one of the kernels MKL tunes for Intel's CPUs only: on AMD's it was measured slower than the Gram's
block upper triangle by plain products (`gram.gram_blocks`), so exact mode takes it on Intel CPUs only.

`gemm_library()` and `gram_kernel()` are the one place that decides; the environment variables
`HF_FEATCAL_CPU_GEMM` (`mkl` or `onednn`) and `HF_FEATCAL_CPU_GRAM` (`syrk` or `blocked`) override
them, for benchmarks and tests. `onednn_linears(root)` routes a block's plain `nn.Linear`s through
oneDNN while gradients are off, in float32, when the decision is oneDNN.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable
from typing import TypeGuard

import torch
from torch import Tensor, nn

from .patching import instance_forwards

#: Overrides `gemm_library()`'s choice: one of `GEMM_LIBRARIES`.
GEMM_LIBRARY_VARIABLE = "HF_FEATCAL_CPU_GEMM"
GEMM_LIBRARIES = ("mkl", "onednn")
#: Overrides `gram_kernel()`'s choice: one of `GRAM_KERNELS`.
GRAM_KERNEL_VARIABLE = "HF_FEATCAL_CPU_GRAM"
GRAM_KERNELS = ("syrk", "blocked")
#: The CPU flag of the vector instructions MKL leaves unused on CPUs that are not Intel's.
WIDE_VECTORS = "avx512f"


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


def _forced(variable: str, choices: tuple[str, ...]) -> str | None:
    """The choice an environment variable forces (None where it is unset or empty)."""
    forced = os.environ.get(variable, "").strip().lower()
    if not forced:
        return None
    if forced not in choices:
        raise ValueError(f"{variable} must be one of {choices}, got {forced!r}.")
    return forced


def _other_x86_vendor() -> bool:
    """Whether this is an x86-64 CPU of a known vendor other than Intel (where MKL does not run the
    kernels it tunes for Intel's)."""
    vendor = cpu_vendor()
    return platform.machine().lower() in ("x86_64", "amd64") and vendor is not None and vendor != "GenuineIntel"


def gemm_library() -> str:
    """"onednn" on an x86-64 CPU that is not Intel's and has AVX-512 (where oneDNN's float32 products
    are faster than MKL's), "mkl" elsewhere; `HF_FEATCAL_CPU_GEMM` overrides the choice."""
    forced = _forced(GEMM_LIBRARY_VARIABLE, GEMM_LIBRARIES)
    if forced is not None:
        if forced == "onednn" and not onednn_available():
            raise RuntimeError(f"{GEMM_LIBRARY_VARIABLE}=onednn, but this torch has no working oneDNN inner product.")
        return forced
    return "onednn" if _other_x86_vendor() and WIDE_VECTORS in cpu_flags() and onednn_available() else "mkl"


def gram_kernel() -> str:
    """How exact mode computes a Gram of unit-weight rows on the CPU: "syrk" (MKL's, its upper triangle
    alone) where MKL runs its own tuned kernels (not on an x86-64 CPU of another vendor than Intel),
    "blocked" (`gram.gram_blocks`' products) elsewhere; `HF_FEATCAL_CPU_GRAM` overrides the choice.
    Where syrk is chosen but missing from this torch, the blocked products run."""
    forced = _forced(GRAM_KERNEL_VARIABLE, GRAM_KERNELS)
    if forced is not None:
        return forced
    return "blocked" if _other_x86_vendor() else "syrk"


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x Wᵀ + b by oneDNN's float32 inner product (x: (..., in), W: (out, in)), as `F.linear`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def plain_float32_cpu(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """float32 CPU operands, no gradient to record, no autocast: where a kernel chosen here may stand
    in for a module's own forward (which torch can differentiate and autocast can cast)."""
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return (
        not recording
        and not torch.is_autocast_enabled("cpu")
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == weight.device.type == "cpu"
    )


def dense_float32_cpu(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Contiguous float32 CPU operands, x at least a matrix and not empty, no gradient to record, no
    autocast (`plain_float32_cpu`): what `onednn_linear` takes fast (else torch's own product runs;
    oneDNN's has no backward; a strided operand would send oneDNN to a generic kernel that was
    measured hundreds of times slower), and what `reuse.linears_into` writes into reused memory."""
    return (
        plain_float32_cpu(x, weight, bias)
        and x.dim() >= 2
        and x.numel() > 0
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def linear_product(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ for x (M, in) and W (out, in), by this CPU's float32 GEMM library (`gemm_library()`):
    oneDNN's inner product where that is the choice and the operands suit it (`dense_float32_cpu`),
    else `torch.mm`."""
    if gemm_library() == "onednn" and dense_float32_cpu(x, weight, None):
        return onednn_linear(x, weight, None)
    return torch.mm(x, weight.T)


def keeps_linear_forward(module: nn.Module) -> TypeGuard[nn.Linear]:
    """An `nn.Linear` whose class keeps `nn.Linear`'s forward: one a kernel here may stand in for."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _onednn_forward(module: nn.Linear) -> Callable[[Tensor], Tensor]:
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        weight, bias = module.weight, module.bias
        return onednn_linear(x, weight, bias) if dense_float32_cpu(x, weight, bias) else own(x)

    return forward


def onednn_linears(root: nn.Module) -> contextlib.AbstractContextManager[None]:
    """While active and `gemm_library()` is "onednn", every Linear in `root` whose class keeps
    `nn.Linear`'s forward computes float32 CPU inputs without gradients (and without autocast) by
    oneDNN (`onednn_linear`); other inputs run its own forward. Modules whose `forward` was already
    replaced on the instance (accelerate's hooks, another patch) are left alone. A no-op where the
    decision is MKL. The class's forward is back on exit, also on error (`patching.instance_forwards`)."""
    if gemm_library() != "onednn":
        return contextlib.nullcontext()
    return instance_forwards(root, lambda module: _onednn_forward(module) if keeps_linear_forward(module) else None)
