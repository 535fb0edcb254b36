"""Merge-method parameters, declared once: name, type, range or choices, default and help.

`hf_featcal.merging` checks its arguments with these declarations (and checks at import that they
match its functions' signatures), `hf_featcal.recipes` validates a recipe's ``merge`` section with
them, and `hf_featcal.cli` generates the ``hf-featcal merge`` flags and their help from them.

Plain frozen dataclasses rather than pydantic: the declarations are a handful of scalars, the package
already uses dataclasses for `FeatCalConfig`, and this module must stay import-light (no torch, no
pydantic) because ``hf-featcal --help`` reads it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

__all__ = ["MergeParameter", "MERGE_PARAMETER_DECLARATIONS", "MERGE_METHOD_ALIASES", "merge_parameters"]


@dataclass(frozen=True)
class MergeParameter:
    """One parameter of a merge method.

    ``kind`` is ``float``, ``int``, ``bool`` or ``str``; a float may carry an ``interval``
    ``(low, high, low_open, high_open)``; a str takes one of ``choices``.
    """

    name: str
    kind: type
    default: Any
    help: str
    interval: tuple[float, float, bool, bool] | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def flag(self) -> str:
        """The ``hf-featcal merge`` option; a bool that defaults to True is switched off by ``--no-NAME``."""
        dashed = self.name.replace("_", "-")
        return f"--no-{dashed}" if self.kind is bool and self.default is True else f"--{dashed}"

    def describe_range(self) -> str:
        if self.interval is not None:
            low, high, low_open, high_open = self.interval
            return ("(" if low_open else "[") + f"{low:g}, {high:g}" + (")" if high_open else "]")
        if self.choices:
            return " | ".join(self.choices)
        return {float: "finite real", int: "integer", bool: "true | false"}.get(self.kind, self.kind.__name__)

    def check(self, value: object) -> Any:
        """``value`` normalised to ``kind``; ValueError with the problem (without the name) otherwise."""
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"must be true or false, got {_show(value)}")
            return value
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise ValueError(f"must be an integer, got {_show(value)}")
            return int(value)
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"must be one of {', '.join(repr(c) for c in self.choices)}, got {_show(value)}")
            return value
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
            raise ValueError(f"must be a finite real number, got {_show(value)}")
        number = float(value)
        if self.interval is not None:
            low, high, low_open, high_open = self.interval
            if (number <= low if low_open else number < low) or (number >= high if high_open else number > high):
                raise ValueError(f"must be in {self.describe_range()}, got {value!r}")
        return number


def _show(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


_SCALING_FACTOR = MergeParameter(
    "scaling_factor", float, 0.3, "task-vector scaling λ: theta = theta_0 + λ·merged task vector", metavar="λ"
)
_MERGE_FUNC = MergeParameter(
    "merge_func", str, "mean", "how the sign-elected entries combine: disjoint mean or sum", choices=("mean", "sum")
)
_DARE = (
    _SCALING_FACTOR,
    MergeParameter("drop_rate", float, 0.9, "probability p of dropping each task-vector entry", interval=(0.0, 1.0, False, True)),
    MergeParameter("rescale", bool, True, "rescale the kept entries (see rescale_mode)"),
    MergeParameter("seed", int, 0, "seed of the drop masks"),
    MergeParameter(
        "rescale_mode", str, "keep_rate",
        "keep_rate: divide kept entries by 1 − p; l1: keep each tensor's L1 norm", choices=("keep_rate", "l1"),
    ),
)

#: Merge method -> its parameters, in the order of the merge function's signature.
MERGE_PARAMETER_DECLARATIONS: dict[str, tuple[MergeParameter, ...]] = {
    "average": (),
    "task_arithmetic": (_SCALING_FACTOR,),
    "ties": (
        _SCALING_FACTOR,
        MergeParameter("density", float, 0.2, "fraction of task-vector entries kept by the magnitude trim",
                       interval=(0.0, 1.0, True, False)),
        MergeParameter("per_tensor_trim", bool, False, "trim each tensor on its own (else over the whole task vector)"),
        _MERGE_FUNC,
    ),
    "dare": _DARE,
    "dare_ties": (*_DARE, dataclasses.replace(_MERGE_FUNC, default="sum")),
}

#: Other accepted method names (``config.hf_featcal_merge`` records use them) -> the declared method.
MERGE_METHOD_ALIASES: dict[str, str] = {"simple_average": "average"}


def merge_parameters(method: str) -> dict[str, MergeParameter]:
    """Name -> declaration of ``method``'s parameters (aliases resolved); KeyError for an unknown method."""
    return {p.name: p for p in MERGE_PARAMETER_DECLARATIONS[MERGE_METHOD_ALIASES.get(method, method)]}
