"""The merge methods by name: each file of `hf_featcal.merging.methods` registers its `MergeMethod`;
the schema, the CLI, recipes, `compare` and `merge_models` read them here (in registration order)."""

from __future__ import annotations

from typing import Any

from .params import MergeMethod

__all__ = ["get_method", "merge_methods", "paper_defaults", "register"]

_METHODS: dict[str, MergeMethod] = {}


def register(method: MergeMethod) -> MergeMethod:
    """Add `method` (its declarations checked against its function); ValueError for a name taken."""
    method.check_declaration()
    taken = {name for other in _METHODS.values() if other.name != method.name for name in (other.name, *other.aliases)}
    clashes = sorted(taken & {method.name, *method.aliases})
    if clashes:
        raise ValueError(f"merge method names {clashes} are already registered")
    _METHODS[method.name] = method
    return method


def get_method(name: str) -> MergeMethod:
    """The method registered under `name` or one of its aliases; KeyError listing the known names."""
    for method in _METHODS.values():
        if name == method.name or name in method.aliases:
            return method
    raise KeyError(f"unknown merge method {name!r}; known: {list(_METHODS)}")


def merge_methods(*, calibration_data: bool | None = None) -> dict[str, MergeMethod]:
    """Name -> method, in registration order; only those that need calibration data (True) or that do
    not (False: the methods ``hf-featcal merge`` and a recipe's ``merge`` section offer)."""
    return {n: m for n, m in _METHODS.items() if calibration_data in (None, m.needs_calibration_data)}


def paper_defaults() -> dict[str, dict[str, Any]]:
    """Merge method → the parameters its paper uses (what each method declares), every registered
    method in registration order: the grid of `hf_featcal.compare` and of a recipe's `compare` section."""
    return {name: dict(method.paper_defaults) for name, method in _METHODS.items()}
