"""Context managers owning the capture hooks FeatCal puts on a model's modules, and `eval_mode`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import Tensor, nn

from .pipeline.streams import StopForward, module_input


class InputCapture(dict):
    """Module name → the input tensor of its last call. `order` lists the names in the order they were
    called in the last forward; with `stop_after` set, the forward is cut short (`StopForward`) right
    after that module's input is stored."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.stop_after: str | None = None


@contextlib.contextmanager
def capture_module_inputs(block: nn.Module, names: Iterable[str]) -> Iterator[InputCapture]:
    """While active, every call of the named submodules of `block` stores its input tensor in the
    yielded `InputCapture`. Hooks are removed on exit, also on error."""
    store = InputCapture()
    handles = []
    try:
        for name in names:
            module = block.get_submodule(name)

            def hook(mod: nn.Module, args: tuple, kwargs: dict, _name: str = name) -> None:
                if _name in store.order:  # a new forward began
                    store.order.clear()
                store[_name] = module_input(args, kwargs)
                store.order.append(_name)
                if store.stop_after == _name:
                    raise StopForward

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_module_outputs(block: nn.Module, names: Iterable[str]) -> Iterator[dict[str, Tensor]]:
    """While active, every call of the named submodules of `block` stores its output tensor in the
    yielded dict (module name → output of its last call). Hooks are removed on exit, also on error."""
    store: dict[str, Tensor] = {}
    handles = []
    try:
        for name in names:

            def hook(mod: nn.Module, args: tuple, output: Tensor, _name: str = name) -> None:
                store[_name] = output

            handles.append(block.get_submodule(name).register_forward_hook(hook))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put modules in eval mode (no dropout) and restore each submodule's training flag on exit."""
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for module, training in flags:
            module.training = training
