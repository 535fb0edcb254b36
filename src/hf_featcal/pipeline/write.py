"""Stage *write*: every solution checked finite, then written into the merged model (also where
accelerate offloaded it; a packed spec replaces its rows of the shared parameter)."""

from __future__ import annotations

from torch import Tensor, nn

from ..architectures import ModuleSpec
from ..parameters import ModelParameters
from .context import check_finite

#: module name → {"weight": tensor, "bias": tensor}: a block's solutions
BlockUpdates = dict[str, dict[str, Tensor]]


def read_spec(parameters: ModelParameters, block: nn.Module, spec: ModuleSpec, attr: str) -> Tensor:
    """A spec's current weight or bias in the merged model (also where accelerate offloaded it)."""
    module = block.get_submodule(spec.owner)
    value = parameters.module_value(module, spec.weight_attr if attr == "weight" else spec.bias_attr)
    return value if spec.rows is None else value[spec.rows[0] : spec.rows[1]]


def write_spec(parameters: ModelParameters, block: nn.Module, spec: ModuleSpec, attr: str, value: Tensor) -> None:
    """Write a spec's weight or bias; a packed spec replaces its rows of the shared parameter."""
    module = block.get_submodule(spec.owner)
    name = spec.weight_attr if attr == "weight" else spec.bias_attr
    if spec.rows is not None:
        packed = parameters.module_value(module, name).clone()
        packed[spec.rows[0] : spec.rows[1]] = value.to(device=packed.device, dtype=packed.dtype)
        value = packed
    parameters.set_module_value(module, name, value)


def write_block(parameters: ModelParameters, block: nn.Module, specs: list[ModuleSpec], updates: BlockUpdates,
                where: str) -> None:
    """Write a block's solutions, all or none: every value is checked finite before the first write."""
    for name, update in updates.items():
        for attr, value in update.items():
            check_finite(value, f"solution for {where}, module {name}.{attr}")
    by_name = {s.name: s for s in specs}
    for name, update in updates.items():
        for attr, value in update.items():
            write_spec(parameters, block, by_name[name], attr, value)
