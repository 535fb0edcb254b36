"""Forwards replaced on module instances for the length of a context: the one mechanism behind the
kernels' context managers (`activations.lean_activations`, `convolutions.patch_products`,
`gemm.onednn_linears`, `reuse.linears_into`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn


@contextlib.contextmanager
def instance_forwards(root: nn.Module, replacement: Callable[[nn.Module], Callable | None]) -> Iterator[None]:
    """While active, every module in `root` for which `replacement(module)` gives a forward runs that
    one (an instance attribute shadows the class's method; module hooks still run around it). Modules
    whose `forward` was already replaced on the instance (accelerate's hooks, another patch) are left
    alone. The class's forward is back on exit, also on error."""
    patched: list[nn.Module] = []
    try:
        for module in root.modules():
            if "forward" in module.__dict__:
                continue
            forward = replacement(module)
            if forward is not None:
                module.forward = forward
                patched.append(module)
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
