"""Linear forwards that reuse their weight packed in MKL's GEMM layout, for FeatCal's repeated block forwards.

A block runs the same weights over many batches: every task's student batches and the
merged-as-given stream through the merged block, the propagation through the calibrated one. A
plain float32 product on the CPU copies the weight into the GEMM kernel's panel layout on every
call. While `packed_linears` is active, a plain `nn.Linear` packs its weight once per row count
(`torch.ops.mkl`, the packed GEMM torch's own compiler uses for frozen CPU linears) and reuses it
for every later batch of that row count: a CLIP B/32 layer's forward at 16 images goes from 39.7–40.4
to 36.6–37.5 ms (median) on this project's 2-core test machine (`benchmarks/packed_linears.py`).

Results stay bit-identical by construction. The packed product is taken for a row count only after
it reproduced the plain product exactly on a real batch of that row count: MKL's packed and plain
paths sum in another order for some shapes (wide inputs at few rows), and those keep the plain
product. Until then, and in every other case (gradients on, autocast, another dtype or device, a
weight changed in place or replaced since it was packed), the plain product runs.

The module's class is switched to `PackingLinear` for the duration (its forward looks its packs up
by module); a copy made meanwhile (an expert block is a deep copy of the merged block) is another
module without packs, so it runs the plain product of its own weights.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The call with a given row count on which the packed product is tried and checked: a module seen
#: for only one or two batches (an expert block of a small task) is never packed.
TRY_AT_CALL = 3
#: Row counts packed per module at most (batches of varying length keep the plain product beyond).
MAX_ROW_COUNTS = 4


@functools.cache
def available() -> bool:
    """Whether this torch has MKL's packed linear kernels."""
    try:
        ops = torch.ops.mkl
        return bool(torch.backends.mkl.is_available()) and hasattr(ops, "_mkl_linear") and hasattr(ops, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


class WeightPacks:
    """One module's packed weights by row count, once the packed product has matched the plain one
    (`packed[rows]`; None: it did not, or packing failed)."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.packed: dict[int, Tensor | None] = {}
        self._packed_for: tuple[int, int, int] | None = None
        self._weight: Tensor | None = None  # held, so that no other tensor can take the packed weight's address

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not _packable(x, weight, bias):
            return F.linear(x, weight, bias)
        # packs belong to one weight (storage, in-place version) and one thread count
        key = (weight.data_ptr(), weight._version, torch.get_num_threads())
        if key != self._packed_for or weight is not self._weight:
            self._packed_for, self._weight, self.calls, self.packed = key, weight, {}, {}
        rows = x.numel() // x.shape[-1]
        packed = self.packed.get(rows)
        if packed is not None:
            return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
        calls = self.calls[rows] = self.calls.get(rows, 0) + 1
        plain = F.linear(x, weight, bias)
        if calls == TRY_AT_CALL and rows not in self.packed and len(self.packed) < MAX_ROW_COUNTS:
            self.packed[rows] = _packed_if_same(x, weight, bias, rows, plain)
        return plain


#: the modules `packed_linears` holds packs for now (a copy of one is not among them)
_PACKS: weakref.WeakKeyDictionary[nn.Module, WeightPacks] = weakref.WeakKeyDictionary()


class PackingLinear(nn.Linear):
    """`nn.Linear` with the forward `packed_linears` gives it: its packs while it holds some,
    `nn.Linear`'s otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        packs = _PACKS.get(self)
        if packs is None:
            return super().forward(x)
        return packs.forward(x, self.weight, self.bias)


def _packable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if x.dim() < 2 or x.numel() == 0 or not x.is_contiguous() or weight.dim() != 2 or not weight.is_contiguous():
        return False
    return bias is None or (bias.device.type == "cpu" and bias.dtype == torch.float32)


def _packed_if_same(x: Tensor, weight: Tensor, bias: Tensor | None, rows: int, plain: Tensor) -> Tensor | None:
    """The weight packed for `rows`, if the packed product of this batch equals `plain` bit for bit."""
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        same = torch.equal(torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows), plain)
    except RuntimeError:
        return None
    return packed if same else None


def runs_linear_forward(module: nn.Module) -> bool:
    """Whether `module` is an `nn.Linear` whose forward computes x Wᵀ + b of its own weight as
    `nn.Linear.forward` does: no instance forward, or Linear's own bound to it (left by accelerate's
    hook removal); `packed_linears`' class counts as Linear (bit-identical)."""
    if type(module) not in (nn.Linear, PackingLinear):
        return False
    forward = module.__dict__.get("forward")
    if forward is None:
        return True
    return getattr(forward, "__func__", None) is nn.Linear.forward and getattr(forward, "__self__", None) is module


@contextlib.contextmanager
def packed_linears(root: nn.Module) -> Iterator[None]:
    """While active, every plain `nn.Linear` in `root` (that exact class or a copy's `PackingLinear`,
    no instance forward: accelerate's hooked modules and subclasses such as PEFT's keep theirs) reuses its weight packed
    for MKL from the third batch of a row count on, where that reproduces the plain product exactly.
    Hold it around a loop over batches through the same weights; on exit, also on error, the packs
    are dropped and every module is an `nn.Linear` again. Without MKL's packed kernels it does nothing."""
    patched: list[tuple[nn.Module, type]] = []
    try:
        if available():
            for module in root.modules():
                # (a PackingLinear without packs is a copy made while its original held some)
                if type(module) in (nn.Linear, PackingLinear) and "forward" not in module.__dict__ and module not in _PACKS:
                    patched.append((module, type(module)))
                    _PACKS[module] = WeightPacks()
                    module.__class__ = PackingLinear
        yield
    finally:
        for module, cls in patched:
            _PACKS.pop(module, None)
            if type(module) is PackingLinear:
                module.__class__ = cls
