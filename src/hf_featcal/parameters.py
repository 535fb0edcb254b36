"""Parameter access that also works for models dispatched by accelerate with CPU or disk offload.

An offloaded module keeps its parameters on the meta device; accelerate's `AlignDevicesHook` loads
them from its `weights_map` for each forward. FeatCal reads merged weights from, and writes calibrated
weights to, that offloaded copy (for disk offload the written values are kept in the loader's CPU
state dict, which takes priority over the files), so the hooks onload the calibrated block for every
later forward — one block at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset
from torch import Tensor, nn


def _offload_hooks(module: nn.Module) -> list[AlignDevicesHook]:
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook) and h.offload and h.weights_map is not None]


class ModelParameters:
    """Read and write a model's parameters by qualified name, wherever they live."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # modules are stable objects; accelerate replaces offloaded Parameter objects at every onload
        self._module_names = {id(m): n for n, m in model.named_modules()}
        # qualified name → (mapping read from, mapping written to, key)
        self._offloaded: dict[str, tuple[Any, MutableMapping, str]] = {}
        for module_name, module in model.named_modules():
            for hook in _offload_hooks(module):
                weights = hook.weights_map
                dataset, prefix = ((weights.dataset, weights.prefix) if isinstance(weights, PrefixedDataset)
                                   else (weights, ""))
                writable = dataset.state_dict if isinstance(dataset, OffloadedWeightsLoader) else dataset
                for name, _ in module.named_parameters(recurse=False):
                    qualified = f"{module_name}.{name}" if module_name else name
                    self._offloaded[qualified] = (dataset, writable, prefix + name)

    @property
    def dispatched(self) -> bool:
        """Whether the model is dispatched by accelerate (offloaded parameters or a device map)."""
        return bool(self._offloaded) or getattr(self.model, "hf_device_map", None) is not None

    def read(self, name: str) -> Tensor:
        """The parameter's current value (a fresh CPU tensor for offloaded ones)."""
        if name in self._offloaded:
            readable, _, key = self._offloaded[name]
            return readable[key]
        return self.model.get_parameter(name).detach()

    def write(self, name: str, value: Tensor) -> None:
        """Set the parameter's value (in the offloaded copy for offloaded ones)."""
        if name in self._offloaded:
            readable, writable, key = self._offloaded[name]
            old = readable[key]
            writable[key] = value.detach().to(device=old.device, dtype=old.dtype).clone()
            return
        param = self.model.get_parameter(name)
        with torch.no_grad():
            param.data.copy_(value.to(device=param.device, dtype=param.dtype))

    def named(self, names: Iterable[str]) -> dict[str, Tensor]:
        return {name: self.read(name) for name in names}

    def qualified_name(self, module: nn.Module, attr: str) -> str:
        """The qualified name of parameter `attr` of a submodule of the model."""
        prefix = self._module_names[id(module)]
        return f"{prefix}.{attr}" if prefix else attr

    def module_value(self, module: nn.Module, attr: str) -> Tensor:
        """`module.<attr>` of a submodule of the model, read through `read`."""
        return self.read(self.qualified_name(module, attr))

    def set_module_value(self, module: nn.Module, attr: str, value: Tensor) -> None:
        self.write(self.qualified_name(module, attr), value)
