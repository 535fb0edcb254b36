"""Patch embeddings on the CPU as one matrix product instead of a convolution.

A vision transformer's patch embedding is a `Conv2d` whose stride equals its kernel, without padding:
its windows do not overlap, so each output position is one patch's pixels times the kernel, and the
whole convolution is the product of the patches (B·rows·cols, C·kh·kw) with the kernel as a
(out, C·kh·kw) matrix. On the CPU torch runs it as a convolution at about two thirds of the float32
product's speed (CLIP ViT-B/32, 16 images of 224²: 29.3 ms against 22.4 ms for the product with its
patch copy, 2-core AMD EPYC; docs/scale.md, "The CPU kernels"), and FeatCal runs it on every
calibration image through the merged model and through the image's expert. The product adds the same
terms in another order: outputs differ by rounding only.

`patch_products(root)` routes such convolutions in `root` through `patch_product` while gradients are
off, for float32 CPU inputs outside autocast; anything else runs the module's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import Tensor, nn

from .gemm import linear_product, plain_float32_cpu
from .patching import instance_forwards


def is_patch_convolution(module: nn.Module) -> bool:
    """A `Conv2d` keeping torch's forward whose windows tile the input: stride equal to the kernel, no
    padding, no dilation, one group."""
    return (
        isinstance(module, nn.Conv2d)
        and type(module).forward is nn.Conv2d.forward
        and tuple(module.stride) == tuple(module.kernel_size)
        and module.padding in ((0, 0), "valid")
        and tuple(module.dilation) == (1, 1)
        and module.groups == 1
    )


def patch_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The non-overlapping convolution of x (B, C, H, W) with weight (out, C, kh, kw) and bias, as one
    product of the patches with the kernel's matrix (rows and columns of pixels past the last whole
    patch are left out, as the convolution leaves them out). Contiguous (B, out, H // kh, W // kw)."""
    batch, channels, height, width = x.shape
    out_channels, _, kh, kw = weight.shape
    rows, cols = height // kh, width // kw
    patches = (
        x[:, :, : rows * kh, : cols * kw]
        .reshape(batch, channels, rows, kh, cols, kw)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(batch * rows * cols, channels * kh * kw)
    )
    out = linear_product(patches, weight.reshape(out_channels, -1))
    if bias is not None:
        out.add_(bias)
    return out.view(batch, rows, cols, out_channels).permute(0, 3, 1, 2).contiguous()


def _runs_as_product(module: nn.Conv2d, x: Tensor) -> bool:
    """float32 CPU operands of matching channels, no gradient to record, no autocast
    (`gemm.plain_float32_cpu`), at least one whole patch: what `patch_product` computes as the module
    would (else its own forward runs, and raises its own errors)."""
    weight = module.weight
    return (
        plain_float32_cpu(x, weight, module.bias)
        and x.dim() == 4
        and x.shape[1] == weight.shape[1]
        and x.shape[2] >= weight.shape[2]
        and x.shape[3] >= weight.shape[3]
        and x.shape[0] > 0
    )


def _product_forward(module: nn.Conv2d) -> Callable[[Tensor], Tensor]:
    own = type(module).forward.__get__(module)

    def forward(x: Tensor) -> Tensor:
        return patch_product(x, module.weight, module.bias) if _runs_as_product(module, x) else own(x)

    return forward


def patch_products(root: nn.Module) -> contextlib.AbstractContextManager[None]:
    """While active, every patch convolution in `root` (`is_patch_convolution`) computes float32 CPU
    inputs without gradients as one product (`patch_product`). Modules whose `forward` was already
    replaced on the instance (accelerate's hooks, another patch) are left alone. The class's forward
    is back on exit, also on error (`patching.instance_forwards`)."""
    return instance_forwards(root, lambda module: _product_forward(module) if is_patch_convolution(module) else None)
