"""Allocation-lean forwards of common activation modules, for FeatCal's block forwards.

An activation written as a chain of tensor expressions, e.g. QuickGELU's `x * sigmoid(1.702 * x)`,
allocates a new tensor for every step. At the width of an MLP's hidden layer each is megabytes, and
on the CPU a fresh buffer of that size is page-faulted in again and again (the allocator hands such
buffers back to the system when they are freed). The forwards here compute the same operations in
the same order on one or two new tensors, updated in place, so their results are equal bit for bit
(checked in `tests/test_activations.py` for float64 down to bfloat16, under autocast, with
infinities and NaN). During a run those new tensors come from memory the run's earlier forwards
used and nobody holds any more (`reuse.ReusableMemory`), so they are not faulted in again. They are
used only while gradients are off; with gradients on, the module's own forward runs.

Modules are matched by their exact class (module and name), so a subclass that changes `forward`
keeps its own; nothing is imported to match them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .patching import instance_forwards
from .reuse import ReusableMemory

#: makes a tensor of a given tensor's shape, dtype and device, its content undefined
Empty = Callable[[Tensor], Tensor]


def quick_gelu(x: Tensor, empty: Empty = torch.empty_like) -> Tensor:
    """`x * torch.sigmoid(1.702 * x)` (transformers' QuickGELUActivation, open_clip's QuickGELU) in one
    new tensor (from `empty`)."""
    out = torch.mul(x, 1.702, out=empty(x))
    out.sigmoid_()
    return out.mul_(x)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def new_gelu(x: Tensor, empty: Empty = torch.empty_like) -> Tensor:
    """`0.5 * x * (1.0 + tanh(sqrt(2/π) * (x + 0.044715 * x**3)))` (transformers' NewGELUActivation,
    `gelu_new`, used by T5 and GPT-2) in two new tensors (from `empty`) instead of eight."""
    inner = torch.pow(x, 3.0, out=empty(x))
    inner.mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_().add_(1.0)
    out = torch.mul(x, 0.5, out=empty(x))
    return out.mul_(inner)


#: "module.ClassName" of an activation module → its lean forward
LEAN_FORWARDS: dict[str, Callable[[Tensor, Empty], Tensor]] = {
    "transformers.activations.QuickGELUActivation": quick_gelu,
    "open_clip.transformer.QuickGELU": quick_gelu,
    "transformers.activations.NewGELUActivation": new_gelu,
}


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _lean_forward(
    module: nn.Module, lean: Callable[[Tensor, Empty], Tensor], empty: Empty
) -> Callable[[Tensor], Tensor]:
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        return own(x) if torch.is_grad_enabled() else lean(x, empty)

    return forward


def lean_activations(root: nn.Module, memory: ReusableMemory | None = None) -> contextlib.AbstractContextManager[None]:
    """While active, every activation module in `root` that `LEAN_FORWARDS` names runs its lean
    forward (bit-identical; see the module docstring), its new tensors taken from `memory` where
    given (`reuse.ReusableMemory`: CPU memory nobody holds any more), else fresh. Modules whose
    `forward` was already replaced on the instance are left alone. The class's forward is back on
    exit, also on error (`patching.instance_forwards`)."""
    empty: Empty = torch.empty_like if memory is None else (lambda x: memory.empty(x.shape, x))

    def replacement(module: nn.Module) -> Callable[[Tensor], Tensor] | None:
        lean = LEAN_FORWARDS.get(_class_name(module))
        return None if lean is None else _lean_forward(module, lean, empty)

    return instance_forwards(root, replacement)
