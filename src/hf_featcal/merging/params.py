"""What a merge method declares, without torch (``hf-featcal --help`` reads it): `MergeParameter`, one
parameter (name, type, default, range or choices, help), and `MergeMethod`, one method (its function,
parameters, paper defaults for the compare grid, paper reference, whether it needs calibration data).

The merge functions check their arguments with these declarations, the recipe validator checks a
recipe's ``merge`` and ``compare`` sections with them, and the CLI generates the ``hf-featcal merge``
flags from them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

__all__ = [
    "CALIBRATION_ARGUMENTS", "MERGE_CONFIG_ATTRIBUTE", "SCALING_FACTOR", "DeclaredFunction", "MergeMethod",
    "MergeParameter",
]

#: Name of the config attribute that records how a model was merged.
MERGE_CONFIG_ATTRIBUTE = "hf_featcal_merge"

#: The keyword arguments a method that needs calibration data takes besides its declared parameters:
#: the data and its batching, as `FeatCalConfig` and `FeatCalCalibrator` take them.
CALIBRATION_ARGUMENTS = ("calibration_data", "num_samples_per_task", "batch_size", "processing_class", "seed")


def show_value(value: object) -> str:
    """A value and its type, as error messages quote it."""
    return f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True)
class MergeParameter:
    """One parameter of a merge method.

    ``kind`` is ``float``, ``int``, ``bool`` or ``str``; a float or an int may carry an ``interval``
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
                raise ValueError(f"must be true or false, got {show_value(value)}")
            return value
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise ValueError(f"must be an integer, got {show_value(value)}")
            return self._within_interval(int(value), value)
        if self.kind is str:
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"must be one of {', '.join(repr(c) for c in self.choices)}, got {show_value(value)}")
            return value
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
            raise ValueError(f"must be a finite real number, got {show_value(value)}")
        return self._within_interval(float(value), value)

    def _within_interval(self, number: Any, value: object) -> Any:
        if self.interval is not None:
            low, high, low_open, high_open = self.interval
            if (number <= low if low_open else number < low) or (number >= high if high_open else number > high):
                raise ValueError(f"must be in {self.describe_range()}, got {value!r}")
        return number


# λ is a small weight in practice (papers and peers use about 0.1-3, negation about -1); the range only
# refuses what can be no more than a typo (1e300 gives a merge full of Inf)
SCALING_FACTOR = MergeParameter(
    "scaling_factor", float, 0.3, "task-vector scaling λ: theta = theta_0 + λ·merged task vector", metavar="λ",
    interval=(-100.0, 100.0, False, False),
)


@dataclass(frozen=True)
class DeclaredFunction:
    """A function with declared parameters: the shape a merge method (`MergeMethod`) and a post-merging
    step (`hf_featcal.post_merging.PostMergingStep`) share.

    ``function`` takes the `fixed_arguments` (the models, the data, what the caller provides) and the
    declared ``parameters`` (in the order of its signature, with its defaults); ``paper_defaults`` are
    the parameters the ``hf-featcal compare`` grid sets (the paper's setting)."""

    name: str
    function: Callable[..., Any]
    summary: str
    reference: str
    parameters: tuple[MergeParameter, ...] = ()
    paper_defaults: Mapping[str, Any] = field(default_factory=dict)
    needs_calibration_data: bool = False

    #: what the declarations are called in errors
    kind_text = "function"

    def fixed_arguments(self) -> tuple[str, ...]:
        """The function's arguments that are not declared parameters."""
        return ()

    def declared(self) -> dict[str, MergeParameter]:
        """Name -> declaration of the parameters."""
        return {p.name: p for p in self.parameters}

    def check(self, **values: object) -> tuple:
        """``values`` checked and normalised by their declarations, in the order given; ValueError
        naming the argument."""
        declared = self.declared()
        out = []
        for name, value in values.items():
            try:
                out.append(declared[name].check(value))
            except ValueError as err:
                raise ValueError(f"`{name}` {err}") from None
        return tuple(out)

    def check_declaration(self) -> None:
        """The parameters name exactly the function's own (besides the `fixed_arguments`), with its
        defaults, and the paper defaults are values the declarations accept (a drift is a programming
        error, caught at registration)."""
        fixed = self.fixed_arguments()
        signature = inspect.signature(self.function).parameters
        from_signature = {n: p.default for n, p in signature.items() if n not in fixed}
        from_declarations = {p.name: p.default for p in self.parameters}
        if from_signature != from_declarations:
            raise RuntimeError(
                f"{self.kind_text} {self.name!r}: {self.function.__name__}'s parameters {from_signature} differ from "
                f"its declarations {from_declarations}"
            )
        missing = [n for n in fixed if n not in signature]
        if missing:
            raise RuntimeError(f"{self.kind_text} {self.name!r}: {self.function.__name__} lacks the arguments "
                               f"{missing}")
        unknown = [n for n in self.paper_defaults if n not in from_declarations]
        if unknown:
            raise RuntimeError(f"{self.kind_text} {self.name!r}: paper defaults for undeclared parameters {unknown}")
        self.check(**self.paper_defaults)


@dataclass(frozen=True)
class MergeMethod(DeclaredFunction):
    """One merge method, as its file in `hf_featcal.merging.methods` declares and registers it.

    ``function(base_model, experts, **parameters)`` returns the merged model; a method that
    ``needs_calibration_data`` also takes the `CALIBRATION_ARGUMENTS`. ``parameters`` are in the
    order of the function's signature, with its defaults; ``paper_defaults`` are the parameters the
    ``hf-featcal compare`` grid sets (the paper's setting); ``aliases`` are other accepted names (the
    ``method`` a ``config.hf_featcal_merge`` record holds).
    """

    aliases: tuple[str, ...] = ()
    #: α of Singular Value Calibration after this merge (FusionBench's SVC config for it; None: SVC's
    #: default), what the compare grid and ``hf-featcal merge --svc`` use unless α is given
    svc_alpha: float | None = None

    kind_text = "merge method"

    def fixed_arguments(self) -> tuple[str, ...]:
        return ("base_model", "experts", *(CALIBRATION_ARGUMENTS if self.needs_calibration_data else ()))

    def check_declaration(self) -> None:
        super().check_declaration()
        if self.svc_alpha is not None and not (isinstance(self.svc_alpha, float) and self.svc_alpha > 0):
            raise RuntimeError(f"merge method {self.name!r}: svc_alpha must be a float > 0, got {self.svc_alpha!r}")
