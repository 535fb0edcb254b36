"""Post-merging steps, after any merge (`hf_featcal.merging`): every step of `post_merging_steps()`
(docs/merge-methods.md lists them with their parameters, reference and cost).

* `hf_featcal.post_merging.registry` (no torch): `PostMergingStep` (what a step declares),
  `PostMergingResult` (what it returns: one model, or the merged model plus per-task modules applied
  given the task), `register_step`, `get_step`, `post_merging_steps`; the schema, the CLI, recipes and
  `hf_featcal.compare` read the steps there.
* `hf_featcal.post_merging.steps`: one file per step (none, featcal, featcal_module, svc, surgery,
  prob_surgery), each with its ``apply`` and the `PostMergingStep` it registers.
* Representation corrections (Representation Surgery and ProbSurgery): `surgery` (`fit_surgery`),
  `task_modules` (`TaskModules`, applied with ``for_task(model, task)``), `representation` (where each
  architecture's head reads), `corrections` (the modules).

Importing this package loads no torch: the step files import it inside their functions.
"""

from __future__ import annotations

from . import steps  # noqa: F401 - registers the shipped steps
from .registry import (
    STEP_ARGUMENTS,
    PostMergingResult,
    PostMergingStep,
    get_step,
    post_merging_steps,
    recipe_step_names,
    register_step,
    step_names,
)

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
