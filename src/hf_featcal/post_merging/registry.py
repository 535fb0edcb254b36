"""The post-merging steps by name, without torch (``hf-featcal --help`` reads them): what a step
declares (`PostMergingStep`: its function, parameters with paper defaults and ranges, reference,
whether it needs calibration data, whether its result is one model or the model plus per-task
modules), what it returns (`PostMergingResult`), and the registry the schema, the CLI, recipes and
`hf_featcal.compare` read (in registration order). Each file of `hf_featcal.post_merging.steps`
registers one step; the parameter machinery is the merge methods' (`hf_featcal.merging.params`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..merging.params import DeclaredFunction

__all__ = [
    "STEP_ARGUMENTS",
    "PostMergingResult",
    "PostMergingStep",
    "get_step",
    "post_merging_steps",
    "recipe_step_names",
    "register_step",
    "step_names",
]

#: The arguments every step's function takes besides its declared parameters: the merged model, the
#: pre-trained base and the experts (task → model), the calibration data (task → data; a data-free
#: step ignores it), ``config`` (a `FeatCalConfig`: its ``num_samples_per_task`` and ``seed`` are the
#: one seeded draw of calibration examples every step of a grid uses, its ``batch_size`` the forward
#: batch; FeatCal runs with all of it), the ``processing_class`` of `datasets.Dataset` calibration data,
#: and the ``device`` to run on.
STEP_ARGUMENTS = ("merged", "base", "experts", "calibration_data", "config", "processing_class", "device")


@dataclass(frozen=True)
class PostMergingResult:
    """What a post-merging step returns: ``model`` (a `PreTrainedModel`), and for a step with per-task
    modules ``task_modules`` (an `hf_featcal.post_merging.task_modules.TaskModules`: the model is used
    for a task inside ``task_modules.for_task(model, task)``); ``report`` is FeatCal's drift report."""

    model: Any
    task_modules: Any = None
    report: Any = None

    @property
    def needs_task(self) -> bool:
        """Whether using the result needs the task at inference."""
        return self.task_modules is not None and bool(self.task_modules.needs_task)

    @property
    def added_parameters(self) -> int:
        """Parameters the result adds to the merged model (0 for a step that changes its weights only)."""
        return 0 if self.task_modules is None else int(self.task_modules.num_parameters())


@dataclass(frozen=True)
class PostMergingStep(DeclaredFunction):
    """One post-merging step, as its file in `hf_featcal.post_merging.steps` declares and registers it.

    ``function(merged, base, experts, calibration_data, *, config, processing_class, device,
    **parameters)`` returns a `PostMergingResult` and leaves its inputs unmodified.
    ``per_task_modules``: the result is the merged model plus per-task modules, applied given the task
    (else one model). ``fusionbench``: FusionBench's class for it, where there is one.
    ``featcal_fields``: for FeatCal and its variants, the `FeatCalConfig` fields the step sets (a recipe
    sets them in its ``featcal`` section and runs FeatCal's own path); None for every other step."""

    per_task_modules: bool = False
    fusionbench: str | None = None
    featcal_fields: tuple[str, ...] | None = None

    kind_text = "post-merging step"

    def fixed_arguments(self) -> tuple[str, ...]:
        return STEP_ARGUMENTS

    @property
    def result_text(self) -> str:
        """What the step's result is, in words (the docs table's and ``--help``'s)."""
        return "model + per-task modules (task needed at inference)" if self.per_task_modules else "one model"

    def checked_parameters(self, values: Mapping[str, Any] | None, where: str = "") -> dict[str, Any]:
        """`values` (name → value) checked by the declarations; ValueError naming `where`, the step and
        the parameter for an unknown name or a refused value."""
        declared = self.declared()
        out: dict[str, Any] = {}
        for name, value in (values or {}).items():
            if name not in declared:
                raise ValueError(f"{where}post-merging step {self.name!r} has no parameter {name!r}; valid: "
                                 f"{list(declared) or 'none'}")
            try:
                out[name] = declared[name].check(value)
            except ValueError as err:
                raise ValueError(f"{where}{self.name}.{name} {err}") from None
        return out

    def run(self, merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any = None, *,
            config: Any = None, processing_class: Any = None, device: Any = None,
            **parameters: Any) -> PostMergingResult:
        """The step on `merged` with its `parameters` (checked first; the undeclared ones take the
        function's defaults); ValueError for a step that needs calibration data and got none."""
        checked = self.checked_parameters(parameters)
        if self.needs_calibration_data and calibration_data is None:
            raise ValueError(f"post-merging step {self.name!r} needs `calibration_data` (task → data)")
        result = self.function(merged, base, experts, calibration_data, config=config,
                               processing_class=processing_class, device=device, **checked)
        if not isinstance(result, PostMergingResult):
            raise TypeError(f"post-merging step {self.name!r} returned {type(result).__name__}, not a "
                            "PostMergingResult")
        return result


_STEPS: dict[str, PostMergingStep] = {}


def register_step(step: PostMergingStep) -> PostMergingStep:
    """Add `step` (its declarations checked against its function); ValueError for a name taken."""
    step.check_declaration()
    if step.name in _STEPS and _STEPS[step.name].function is not step.function:
        raise ValueError(f"post-merging step {step.name!r} is already registered")
    if "+" in step.name or "@" in step.name:  # the compare grid's rows are "<merge>+<step>@<examples>"
        raise ValueError(f"post-merging step names cannot hold '+' or '@', got {step.name!r}")
    _STEPS[step.name] = step
    return step


def get_step(name: str) -> PostMergingStep:
    """The step registered under `name`; KeyError listing the known names."""
    try:
        return _STEPS[name]
    except KeyError:
        raise KeyError(f"unknown post-merging step {name!r}; known: {list(_STEPS)}") from None


def post_merging_steps(*, calibration_data: bool | None = None) -> dict[str, PostMergingStep]:
    """Name → step, in registration order; only those that need calibration data (True) or not (False)."""
    return {n: s for n, s in _STEPS.items() if calibration_data in (None, s.needs_calibration_data)}


def step_names() -> tuple[str, ...]:
    """The registered steps' names, in registration order (read when asked: a step registered later is in it)."""
    return tuple(_STEPS)


def recipe_step_names() -> tuple[str, ...]:
    """The steps a recipe's ``post_merging`` runs: ``featcal`` (FeatCal as the ``featcal`` section sets it)
    and every step that is not a FeatCal variant (whose settings are the ``featcal`` section's fields)."""
    return tuple(name for name, step in _STEPS.items() if name == "featcal" or step.featcal_fields is None)

