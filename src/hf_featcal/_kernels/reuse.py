"""Memory reused by a run's block forwards on the CPU, instead of fresh tensors for every output.

A block forward writes each Linear's output and each activation's into a new tensor. At an MLP's
hidden width each is megabytes, and glibc hands blocks of that size back to the system once they
are freed, so every new one is page-faulted in again (on the CLIP benchmark at 8 tasks × 256 images,
~2.5 M page faults and 6–8 s of system time). `ReusableMemory` keeps the tensors it handed out and
hands one out again once nobody holds it any more: no tensor can see its content change, because a
tensor that still refers to the memory keeps it from being handed out. The outputs are computed by
the same kernels (`torch.addmm(..., out=)`, the activations' own operations with `out=`), so they
are equal bit for bit (tests/test_reused_memory.py).

Whether anybody holds a tensor's memory is read from the use count of its storage, a function of
torch's C API (`torch._C._storage_Use_Count`); where this torch lacks it, nothing is kept and every
tensor is new (`ReusableMemory.empty` is then `torch.empty`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .gemm import dense_float32_cpu, keeps_linear_forward
from .patching import instance_forwards

_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(tensor: Tensor) -> int:
    assert _storage_use_count is not None  # only called where the count can be read
    return _storage_use_count(tensor.untyped_storage()._cdata)


class ReusableMemory:
    """CPU tensors handed out again once nobody holds them (see the module docstring).

    `empty(shape, like)` gives a contiguous tensor of `shape` with `like`'s dtype and device: a
    view of a kept block of memory that no tensor refers to and that is at most twice its size (the
    smallest such: a tensor that outlives the run's forwards, e.g. one kept in a stream, then holds
    at most twice its own memory), or a new one, kept for later. At most
    `max_kept` blocks and `max_bytes` are kept; beyond that the oldest blocks nobody holds are let
    go first (a block somebody holds is then no longer kept, and is freed with its last tensor)."""

    def __init__(self, max_kept: int = 32, max_bytes: int = 512 << 20) -> None:
        self.max_kept, self.max_bytes = max_kept, max_bytes
        # (flat block, its storage's use count when only this list holds it), oldest first
        self._kept: list[tuple[Tensor, int]] = []

    @staticmethod
    def available() -> bool:
        """Whether this torch lets memory be reused safely (the storage use count can be read)."""
        return _storage_use_count is not None

    def empty(self, shape: tuple[int, ...] | torch.Size, like: Tensor) -> Tensor:
        """A contiguous tensor of `shape`, `like`'s dtype and device, its content undefined."""
        numel = math.prod(shape)
        if not self.available() or like.device.type != "cpu" or numel == 0:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        best = None
        for index, (block, alone) in enumerate(self._kept):
            fits = numel <= block.numel() <= 2 * numel
            if block.dtype == like.dtype and fits and _use_count(block) == alone:
                if best is None or block.numel() < self._kept[best][0].numel():
                    best = index
        if best is not None:
            entry = self._kept.pop(best)
            self._kept.append(entry)  # the most recently used is let go last
            return entry[0][:numel].view(shape)
        block = torch.empty(numel, dtype=like.dtype, device=like.device)
        self._kept.append((block, _use_count(block)))
        out = block.view(shape)
        self._trim()  # (after the view is made: the new block is held, not let go first)
        return out

    def _trim(self) -> None:
        """Let go of the oldest kept blocks beyond `max_kept` or `max_bytes`."""
        while len(self._kept) > self.max_kept or (
            len(self._kept) > 1 and self.kept_bytes > self.max_bytes
        ):
            free = next((i for i, (b, alone) in enumerate(self._kept) if _use_count(b) == alone), 0)
            self._kept.pop(free)

    def clear(self) -> None:
        """Let go of every kept block (their tensors still held elsewhere stay valid)."""
        self._kept.clear()

    @property
    def kept_bytes(self) -> int:
        """The bytes of the blocks kept now."""
        return sum(b.numel() * b.element_size() for b, _ in self._kept)


def _linear_into(module: nn.Linear, memory: ReusableMemory) -> Callable[[Tensor], Tensor]:
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        weight, bias = module.weight, module.bias
        if not dense_float32_cpu(x, weight, bias):
            return own(x)
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        out = memory.empty((rows, weight.shape[0]), x)
        # the kernels `F.linear` runs for these operands, writing into `out`
        if bias is None:
            torch.mm(flat, weight.T, out=out)
        else:
            torch.addmm(bias, flat, weight.T, out=out)
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


def linears_into(root: nn.Module, memory: ReusableMemory | None) -> contextlib.AbstractContextManager[None]:
    """While active, every Linear in `root` whose class keeps `nn.Linear`'s forward writes the output
    of float32 CPU inputs without gradients (and without autocast) into `memory` (bit for bit what
    its own forward gives); other inputs run its own forward. Linears whose `forward` was already
    replaced on the instance (accelerate's hooks, `gemm.onednn_linears`) are left alone. A no-op
    without `memory`. The class's forward is back on exit, also on error."""
    if memory is None or not memory.available():
        return contextlib.nullcontext()
    return instance_forwards(
        root, lambda module: _linear_into(module, memory) if keeps_linear_forward(module) else None
    )
