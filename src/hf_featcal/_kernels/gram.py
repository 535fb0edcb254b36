"""Block-upper-triangle Grams and the products that build them, for FeatCal's statistics.

A Gram aᵀa is symmetric, so the statistics keep only its block upper triangle (`gram_blocks`): the
products below the block diagonal are never computed, and the functions here add into, mirror,
multiply by and take the norm of such a triangle. Products run in float32 or better; fast mode's
low-precision factors go through `product`, which picks the kernel that is faster on the device
(`gemm.low_precision_products`, `mkl_products.addmm_low_`); exact mode's unit-weight Grams take
MKL's syrk where it is available and the faster kernel (`mkl_products.syrk_upper_`,
`gemm.gram_kernel`). Their speed is measured in docs/scale.md ("The CPU kernels").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gemm import ROUNDED_RESULTS, gram_kernel, low_precision_products
from .mkl_products import addmm_low_, syrk_upper_

#: Inputs at least this wide get their Gram as a blocked upper triangle (below it one product is cheaper).
BLOCKED_GRAM_MIN_DIM = 512


def gram_blocks(dim: int) -> list[tuple[int, int]]:
    """Column blocks of a `dim`-wide Gram accumulated as its block upper triangle: 8 blocks from 2048
    on (9/16 of the full product's arithmetic), 4 from `BLOCKED_GRAM_MIN_DIM` (5/8), else one (the
    full product). Block edges are multiples of 64, so every product keeps aligned shapes."""
    if dim < BLOCKED_GRAM_MIN_DIM:
        return [(0, dim)]
    count = 8 if dim >= 2048 else 4
    size = -(-dim // count)
    size = -(-size // 64) * 64
    return [(start, min(start + size, dim)) for start in range(0, dim, size)]


def product(a: Tensor, b: Tensor, low: torch.dtype | None, out: Tensor | None = None) -> Tensor:
    """a @ b (float32 or better), added into `out` when given. With `low` (fast mode) the factors
    are cast to that dtype and the product comes out in float32: on CUDA by `torch.mm(...,
    out_dtype=)`, on the CPU by MKL's mixed-precision GEMM (`mkl_products.addmm_low_`, which adds
    it into a float32 `out` in place). On a CPU where torch's own low-precision product is the
    faster one (`gemm.low_precision_products` is `ROUNDED_RESULTS`), and where neither is
    available, the product is rounded to `low` once per batch, as the inputs already are, and
    converted back before it is added to the sums."""
    if low is None:
        return torch.mm(a, b) if out is None else out.addmm_(a, b)
    a, b = a.to(low), b.to(low)
    if a.is_cuda:
        try:
            result = torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without out_dtype
            result = torch.mm(a, b)
    elif low_precision_products(low, a.device) == ROUNDED_RESULTS:
        result = torch.mm(a, b)  # oneDNN's matmul, rounded to `low`
    elif out is not None:
        if addmm_low_(out, a, b):
            return out
        result = torch.mm(a, b)
    else:
        result = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        if not addmm_low_(result, a, b, beta=0.0):
            result = torch.mm(a, b)
    result = result.float()  # (converting first, then a float32 add, is ~2× faster than a mixed-dtype add)
    return result if out is None else out.add_(result)


def add_upper_gram(acc: Tensor, a: Tensor, b: Tensor, low: torch.dtype | None = None) -> None:
    """acc += aᵀ b on the block upper triangle of `gram_blocks(acc.shape[0])` only (a Gram is
    symmetric; `symmetric_from_upper` restores the rest). a, b: (M, d).

    When `a` is `b` (a Gram of unit-weight rows) in exact mode on a CPU where syrk is the choice
    (`gemm.gram_kernel`), MKL's syrk adds aᵀa on the upper triangle alone, at half a full product's
    arithmetic (the blocked product: 9/16 from 2048 wide, 5/8 from 512; `mkl_products.syrk_upper_`):
    the halves of the diagonal blocks below the diagonal are then left as they were, and
    `mirror_diagonal_blocks_` fills them in before the sum is read."""
    if low is None and a is b and gram_kernel() == "syrk" and syrk_upper_(acc, a):
        return
    for start, stop in gram_blocks(acc.shape[0]):
        product(a[:, start:stop].T, b[:, start:], low, out=acc[start:stop, start:])


def mirror_diagonal_blocks_(upper: Tensor) -> Tensor:
    """Overwrite the part of each diagonal block of `gram_blocks` below the diagonal with the mirror
    of the part above it, in place: after `add_upper_gram`'s syrk, the block upper triangle whole."""
    for start, stop in gram_blocks(upper.shape[0]):
        block = upper[start:stop, start:stop]
        block.copy_(block.triu().add_(block.triu(1).mT))
    return upper


def upper_blocks(upper: Tensor) -> list[Tensor]:
    """Views of the block rows of a block upper triangle kept by `add_upper_gram` (from the diagonal
    block rightwards): the only part written, so the only part element-wise updates need to touch
    (the blocks below stay zero, or hold a mirror that the next read rewrites)."""
    return [upper[start:stop, start:] for start, stop in gram_blocks(upper.shape[0])]


def symmetric_upper_product(upper: Tensor, b: Tensor) -> Tensor:
    """S @ b for the symmetric S whose block upper triangle `upper` holds (`add_upper_gram`'s
    layout; what lies below it is not read), as a new tensor."""
    out = torch.empty(upper.shape[0], b.shape[1], dtype=upper.dtype, device=upper.device)
    for start, stop in gram_blocks(upper.shape[0]):
        torch.mm(upper[start:stop, start:], b[start:], out=out[start:stop])
        if start > 0:  # the blocks left of the diagonal are the mirrors of those above it
            out[start:stop].addmm_(upper[:start, start:stop].T, b[:start])
    return out


def symmetric_from_upper(upper: Tensor) -> Tensor:
    """The full symmetric matrix of a block upper triangle kept by `add_upper_gram` (a new tensor)."""
    return mirror_upper_(upper.clone())


def mirror_upper_(upper: Tensor) -> Tensor:
    """Overwrite the blocks below the block diagonal with the mirror of those above it, in place:
    the full symmetric matrix of a block upper triangle, without allocating another (a fresh matrix
    of the fc2 Gram's size costs more in page faults than the mirroring itself)."""
    blocks = gram_blocks(upper.shape[0])
    for i, (r0, r1) in enumerate(blocks):
        for c0, c1 in blocks[i + 1 :]:
            upper[c0:c1, r0:r1] = upper[r0:r1, c0:c1].T
    return upper


def upper_gram_norm(upper: Tensor) -> float:
    """Frobenius norm of the full symmetric matrix of a block upper triangle: each diagonal block
    once, each block right of it twice (it stands for itself and its mirror); the blocks below the
    block diagonal are not read.

    Summed from the norms of single rows, in float64: torch's float32 norm of a whole matrix sums
    millions of squares in float32 (relative error 3.5e-4 measured on a 3072-wide Gram, where s_i
    must be exact to float precision); the norm of one row of a few thousand is exact to ~1e-7."""
    dim, total = upper.shape[0], 0.0
    for start, stop in gram_blocks(dim):
        rows = torch.linalg.vector_norm(upper[start:stop, start:stop], dim=1).double()
        total += float(rows.dot(rows))
        if stop < dim:
            rows = torch.linalg.vector_norm(upper[start:stop, stop:], dim=1).double()
            total += 2.0 * float(rows.dot(rows))
    return total**0.5
