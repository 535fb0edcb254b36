"""Reporting shared by the benchmarks (`bench_clip.py`, `bench_llama.py`): this process's peak RSS,
the machine's measured matmul peak per dtype, the library's arithmetic shares (blocked Gram
triangles, triangular products) and the per-stage table of seconds, TFLOP, TFLOP/s and fraction of
the peak of each stage's dtype. And the set-up of the checkpoint-cost benchmarks
(`fingerprint_cost.py`, `checkpoint_digest_cost.py`): a random CLIP ViT-B/32-shaped tower with two
experts, their merge and image batches (`clip_tower_run`), and the seconds spent in library functions
(`timing_calls`). And `ProductCount`: the arithmetic of the matrix products a run dispatches, counted
the same way for any code (the side-by-side counts the authors' demo and hf_featcal with it).

The scripts run with their own folder on `sys.path`, so they import this module as `bench_common`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import conv_flop_count

#: dtype of each timed stage's products, by mode: block forwards run in the forward dtype (fast mode's
#: autocast dtype, else the model's); statistics accumulate in float32 except that fast mode's Gram
#: products take forward-dtype inputs; solving is float32 (`compute_dtype`).
FORWARD_STAGES = ("block forwards", "propagating", "drift (merged-as-given stream)")


def stage_dtypes(model_dtype: str, forward_dtype: str | None, low_products: bool = True) -> dict[str, str]:
    """The dtype whose matmul peak each stage is measured against (`low_products`: whether fast
    mode's statistics take forward-dtype factors here, `low_products_in_use`)."""
    forward = forward_dtype or model_dtype
    statistics = forward_dtype if forward_dtype is not None and low_products else "float32"
    return {**{stage: forward for stage in FORWARD_STAGES}, "statistics": statistics, "solving": "float32"}


def _product_flop(name: str, args: tuple, out: Any) -> int | None:
    """Floating-point operations (2 per multiply-add) of one dispatched product, by the op's name
    (overload packet, without the namespace); None for an op that is not a product."""
    def dims(t: Any) -> list[int]:
        return list(t.shape)

    if name in ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        *batch, m, k = dims(a)
        n = dims(b)[-1]
        return 2 * (batch[0] if batch else 1) * m * k * n
    if name in ("mv", "addmv", "addmv_"):
        m, n = dims(args[0] if name == "mv" else args[1])
        return 2 * m * n
    if name in ("addr", "addr_"):
        return 2 * dims(args[1])[0] * dims(args[2])[0]
    if name == "_linear_pointwise":  # oneDNN's inner product (mkldnn), x (..., in) by W (out, in)
        x, w = args[0], args[1]
        return 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
    if name.startswith("_scaled_dot_product") and "backward" not in name:
        q, k, v = args[0], args[1], args[2]  # (B, H, L, E), (B, H, S, E), (B, H, S, Ev)
        *lead, length, e = dims(q)
        return 2 * (q.numel() // (length * e)) * length * k.shape[-2] * (e + v.shape[-1])
    if name in ("convolution", "_convolution"):
        result = out[0] if isinstance(out, (tuple, list)) else out
        return int(conv_flop_count(dims(args[0]), dims(args[1]), dims(result), bool(args[6])))
    return None


class ProductCount(TorchDispatchMode):
    """While active, the floating-point operations of every matrix product dispatched (mm, addmm and
    its in-place form, batched products, matrix-vector and outer products, attention, convolutions,
    oneDNN's inner product), summed by op: a count that reads any code the same way, as torch runs it.

    Not counted: factorisations and solves (their cost is not a product's; their calls are listed in
    `solver_calls`), element-wise work, and products a library calls outside torch's dispatcher
    (hf_featcal's MKL syrk: run with `HF_FEATCAL_CPU_GRAM=blocked` to count its Grams)."""

    def __init__(self) -> None:
        super().__init__()
        self.flop: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.solver_calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        flop = _product_flop(name, args, out)
        if flop is not None:
            self.flop[name] = self.flop.get(name, 0) + flop
            self.calls[name] = self.calls.get(name, 0) + 1
        elif name.startswith(("linalg_", "_linalg_", "cholesky", "triangular_solve")) and "check" not in name:
            self.solver_calls[name] = self.solver_calls.get(name, 0) + 1
        return out

    @property
    def total(self) -> int:
        """All counted products' floating-point operations."""
        return sum(self.flop.values())

    def to_dict(self) -> dict[str, Any]:
        return {"flop": self.total, "by_op": dict(self.flop), "calls": dict(self.calls),
                "solver_calls": dict(self.solver_calls)}


def peak_rss_gib() -> float:
    """This process's own peak RSS (`VmHWM`): `ru_maxrss` survives `execve`, so a child started right
    after `prepare()` would report the parent's peak."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _library_module(*names: str) -> ModuleType | None:
    """The first of the library's modules `names` that imports: a benchmark may run an older revision,
    where a module had another name (`_kernels.gemm` was `cpu_gemm`) or did not exist yet (None)."""
    for name in names:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    return None


def _float32_cpu_product():
    """The float32 CPU product the library runs (`hf_featcal._kernels.gemm`: oneDNN's on x86-64 CPUs that
    are not Intel's, where it is faster than MKL's), or None for torch's own (also for libraries from
    before that choice existed)."""
    gemm = _library_module("hf_featcal._kernels.gemm", "hf_featcal.cpu_gemm")
    if gemm is None:
        return None
    return (lambda a, b: gemm.onednn_linear(a, b, None)) if gemm.gemm_library() == "onednn" else None


def matmul_throughput(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] | None = None,
                      seconds: float = 0.3) -> float:
    """This machine's matmul throughput (FLOP/s) in `dtype`: the best of square products of a few sizes
    (larger on a GPU, where 3072² products do not fill the device), each repeated for about `seconds`.
    Float32 on the CPU: the best of torch's product and the library's own where it runs another
    (`_float32_cpu_product`)."""
    if sizes is None:
        sizes = (2048, 4096, 8192) if device.type == "cuda" else (1024, 2048, 3072)
    own = _float32_cpu_product() if device.type == "cpu" and dtype == torch.float32 else None
    if own is not None:
        return max(_throughput(device, dtype, sizes, seconds, lambda a, b: a @ b),
                   _throughput(device, dtype, sizes, seconds, own))
    return _throughput(device, dtype, sizes, seconds, lambda a, b: a @ b)


def _throughput(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], seconds: float, multiply) -> float:
    """The best FLOP/s of `multiply(a, b)` on square `dtype` matrices of `sizes`."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        multiply(a, b)  # warm-up (and, on a slow path, how many repeats fit in `seconds`)
        sync()
        start = time.perf_counter()
        multiply(a, b)
        sync()
        repeats = max(1, min(50, int(seconds / max(time.perf_counter() - start, 1e-6))))
        start = time.perf_counter()
        for _ in range(repeats):
            multiply(a, b)
        sync()
        best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
        del a, b
    return best


def triangle_fraction(dim: int, syrk: bool = False) -> float:
    """The share of a full `dim`-wide Gram product x_sᵀx_s the library computes. `syrk` (exact mode
    on the CPU, unit token weights: `syrk_in_use`): MKL's syrk, the upper triangle alone, (dim+1)/(2·dim).
    Otherwise the block upper triangle of `hf_featcal._kernels.gram.gram_blocks` (block j against blocks
    ≥ j; 8 equal blocks: (8+1)/(2·8) = 9/16, 4 blocks: 5/8, one block: 1), mirrored at task end;
    9/16 when the library does not say."""
    if syrk:
        return (dim + 1) / (2 * dim)
    gram = _library_module("hf_featcal._kernels.gram", "hf_featcal.statistics")
    if gram is None or not hasattr(gram, "gram_blocks"):
        return 9 / 16
    return sum((stop - start) * (dim - start) for start, stop in gram.gram_blocks(dim)) / dim**2


def low_products_in_use(device: torch.device, forward_dtype: str | None) -> bool:
    """Whether fast mode's statistics' products take forward-dtype factors here
    (`hf_featcal._kernels.gemm.low_precision_products_pay`; always, for libraries from before that choice)."""
    if forward_dtype is None:
        return False
    gemm = _library_module("hf_featcal._kernels.gemm", "hf_featcal.cpu_gemm")
    if gemm is None or not hasattr(gemm, "low_precision_products_pay"):
        return True
    return gemm.low_precision_products_pay(getattr(torch, forward_dtype), device)


def syrk_in_use(device: torch.device, forward_dtype: str | None) -> bool:
    """Whether the library computes unit-weight Grams by MKL's syrk here (`hf_featcal._kernels.mkl_products`;
    False for libraries from before it): on the CPU, wherever the statistics' products are float32 and
    syrk is the CPU's choice (`hf_featcal._kernels.gemm.gram_kernel`; libraries from before it: always)."""
    mkl = _library_module("hf_featcal._kernels.mkl_products", "hf_featcal.mkl_products")
    if mkl is None or not hasattr(mkl, "syrk_available"):
        return False
    gemm = _library_module("hf_featcal._kernels.gemm")
    if gemm is not None and hasattr(gemm, "gram_kernel") and gemm.gram_kernel() != "syrk":
        return False
    return not low_products_in_use(device, forward_dtype) and device.type == "cpu" and mkl.syrk_available(torch.float32)


def lower_triangular_fraction(dim: int) -> float:
    """The share of a full product a @ L (L: `dim`×`dim` lower triangular) that
    `hf_featcal.solver.lower_triangular_product` computes: one full product below
    `BLOCKED_CHOLESKY_MIN_DIM`, else column blocks of 384 against the rows at and below each block."""
    try:
        from hf_featcal.solver import BLOCKED_CHOLESKY_MIN_DIM
    except ImportError:
        BLOCKED_CHOLESKY_MIN_DIM = 1024
    if dim < BLOCKED_CHOLESKY_MIN_DIM:
        return 1.0
    return sum((dim - start) * (min(start + 384, dim) - start) for start in range(0, dim, 384)) / dim**2


def rate_report(flops: dict[str, float], timings: dict[str, float], dtypes: dict[str, str],
                peaks: dict[str, float]) -> dict:
    """The result keys shared by the benchmarks, from FLOPs and seconds per stage, each stage's dtype
    and the measured matmul peak (FLOP/s) per dtype: TFLOP per stage, the stages' dtypes, the peaks in
    TFLOP/s, the counted stages' overall fraction of peak and each one's own."""
    counted = [k for k in flops if timings.get(k)]
    work = sum(timings[k] for k in counted)
    ideal = sum(flops[k] / peaks[dtypes[k]] for k in counted)  # seconds at each stage's dtype peak
    return {
        "tflop": {k: v / 1e12 for k, v in flops.items()},
        "stage_dtypes": dtypes,
        "measured_matmul_tflops": {k: v / 1e12 for k, v in peaks.items()},
        # Σ (stage FLOPs / its dtype's peak) ÷ Σ stage seconds, over the stages that are counted
        "block_work_fraction_of_matmul_peak": ideal / work if work else None,
        "fraction_of_matmul_peak_per_stage": {k: flops[k] / timings[k] / peaks[dtypes[k]] for k in counted},
    }


def stage_rows(result: dict) -> list[tuple[str, float, float | None, float | None, float | None, str | None]]:
    """(stage, seconds, TFLOP, TFLOP/s, fraction of its dtype's peak, dtype) for every timed stage."""
    rows = []
    for stage, seconds in result["seconds_per_stage"].items():
        tflop = result["tflop"].get(stage)
        dtype = result["stage_dtypes"].get(stage)
        rate = tflop / seconds if tflop is not None and seconds > 0 else None
        fraction = result["fraction_of_matmul_peak_per_stage"].get(stage)
        rows.append((stage, seconds, tflop, rate, fraction, dtype))
    return rows


def stage_table(result: dict, title: str) -> str:
    """A markdown table of `stage_rows` under `title`, then the run's total, memory and measured peaks."""
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        title,
        "| stage | seconds | TFLOP | TFLOP/s | fraction of peak | peak dtype |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for stage, seconds, tflop, rate, fraction, dtype in stage_rows(result):
        lines.append(
            f"| {stage} | {seconds:.2f} | {fmt(tflop, '.3f')} | {fmt(rate, '.3f')} | {fmt(fraction, '.3f')} | "
            f"{dtype or '-'} |"
        )
    device_mem = "-" if result["peak_device_gib"] is None else f"{result['peak_device_gib']:.2f} GiB"
    peaks = ", ".join(f"{k} {v:.2f}" for k, v in result["measured_matmul_tflops"].items())
    lines.append(
        f"total {result['seconds_total']:.2f} s · {sum(result['tflop'].values()):.2f} TFLOP · fraction of peak "
        "(counted stages) "
        f"{fmt(result['block_work_fraction_of_matmul_peak'], '.3f')} · peak RSS {result['peak_rss_gib']:.2f} GiB · "
        f"peak device {device_mem} · measured matmul peak (TFLOP/s): {peaks}"
    )
    return "\n".join(lines)


@dataclass
class ClipTowerRun:
    """What a calibration run of the checkpoint-cost benchmarks takes: the base, two experts (the base
    plus 1 % noise each), their mean as the merged model and one batch of random images per task; and
    the command line it was built from."""

    args: argparse.Namespace
    base: torch.nn.Module
    experts: dict[str, torch.nn.Module]
    merged: torch.nn.Module
    data: dict[str, list[dict[str, torch.Tensor]]]


def clip_tower_run(argv: list[str] | None = None) -> ClipTowerRun:
    """The run of the command line `argv` (default: `sys.argv`): a random CLIP ViT-B/32-shaped vision
    tower of ``--layers`` blocks (12) of width ``--hidden`` (768), ``--samples`` 224² images per task (16);
    sets torch's thread count to ``--threads`` (2) and seeds it."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=max(1, args.hidden // 64), image_size=224, patch_size=32)
    base = CLIPVisionModel(config).eval()
    experts = {}
    for i, task in enumerate(("a", "b")):
        expert = copy.deepcopy(base)
        generator = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
        experts[task] = expert
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.copy_(sum(e.get_parameter(name) for e in experts.values()) / len(experts))
    generator = torch.Generator().manual_seed(0)
    data = {t: [{"pixel_values": torch.randn(args.samples, 3, 224, 224, generator=generator)}] for t in experts}
    return ClipTowerRun(args, base, experts, merged, data)


@contextlib.contextmanager
def timing_calls(functions: dict[str, tuple[ModuleType | type, str]]) -> Iterator[dict[str, float]]:
    """While open, each call of ``module.<name>`` (label → (module or class, name)) adds its seconds to the yielded
    dict under its label (callers that bound the function under another name are not seen); the
    module's own functions are put back on exit."""
    spent = dict.fromkeys(functions, 0.0)
    originals = {label: getattr(module, name) for label, (module, name) in functions.items()}

    def timed(label: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        return wrapper

    try:
        for label, (module, name) in functions.items():
            setattr(module, name, timed(label, originals[label]))
        yield spent
    finally:
        for label, (module, name) in functions.items():
            setattr(module, name, originals[label])
