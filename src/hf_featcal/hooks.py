"""Context managers owning every hook and temporary change FeatCal makes to a model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .streams import StopForward, module_input


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


@contextlib.contextmanager
def restore_on_failure(model: nn.Module, parameter_names: Iterable[str], parameters: Any = None) -> Iterator[None]:
    """If the body raises, put `model` back exactly as it was: the named parameters' values (kept as
    a CPU copy while the body runs) and the device and dtype of every parameter and buffer.
    `parameters` (a `ModelParameters`) reads and writes values also where accelerate offloaded them."""
    if parameters is None:
        from .offload import ModelParameters

        parameters = ModelParameters(model)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    placement = {name: (t.device, t.dtype) for name, t in tensors.items()}
    snapshot = {name: parameters.read(name).to("cpu", copy=True) for name in parameter_names}
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for name, module_tensor in _named_tensors(model):
                device, dtype = placement[name]
                if device.type == "meta" or module_tensor.is_meta:
                    continue  # offloaded by accelerate: its hooks own the placement, the value is restored below
                if module_tensor.device != device or module_tensor.dtype != dtype:
                    module_tensor.data = module_tensor.data.to(device=device, dtype=dtype)
            for name, value in snapshot.items():
                parameters.write(name, value)
        raise


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
