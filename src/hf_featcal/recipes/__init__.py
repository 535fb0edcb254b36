"""YAML recipes: merge → FeatCal → evaluate → save (→ push), described in one file.

A recipe is read with ``yaml.safe_load`` (no code is ever executed; a key given twice in one mapping is
refused, naming it and its lines) and validated into a
:class:`Recipe` *before anything is downloaded*: every error is a :class:`RecipeError` that names
the offending key path (e.g. ``merge.density``) and unknown keys are rejected. Models are loaded
with ``trust_remote_code=False``; datasets through ``datasets.load_dataset`` (which runs no dataset
scripts) or, for local folders, ``datasets.load_from_disk``.

Schema (``?`` marks optional keys; defaults in brackets; ``<task>`` is an expert's task name). It is
generated from the declarations in `hf_featcal.schema` (`RECIPE_SECTIONS`, the merge parameters and
the fields of `FeatCalConfig`), which also drive the validation and the matching CLI flags::

    <recipe schema>

``hf-featcal compare RECIPE`` runs the grid merges × post-merging steps on the recipe's base,
experts, calibration data and evaluation; the merges are the recipe's ``compare.merges`` when it has a
``compare`` section (without ``merges``: every merge), else its own ``merge`` (``--all-merges``: every
merge; `hf_featcal.compare.recipe_grid`). A method's parameters are laid over its
``DEFAULT_MERGES`` entry; their names and values are checked here with the rest of the recipe (so
``run --check`` refuses a bad one too).

Relative *input* paths (models, datasets) are looked up relative to the recipe's folder first, then
the working directory; a value that is neither an existing local path nor a valid hub id is an
error. ``output_dir`` is relative to the working directory.

For ``flan_t5`` every task's calibration data goes through
:func:`hf_featcal.evaluation.preprocess_glue_dataset` (the experts' prompt format, the label text as
decoder target) and evaluation uses :func:`hf_featcal.evaluation.evaluate_glue`. For ``clip`` the
calibration images are processed by the base's ``CLIPImageProcessor`` and evaluation is zero-shot
classification with the base's text tower
(:func:`hf_featcal.evaluation.clip_zeroshot.evaluate_clip_zeroshot`). ``open_clip`` works like
``clip`` with open_clip checkpoints (experts as ``hf-hub:`` / ``local-dir:`` references or folders):
images go through the checkpoint's own preprocess transform, zero-shot heads come from the model's own
text tower, and the result is saved the open_clip way.

The per-task ``num_examples`` decides how many calibration examples are used (the dataset is
shuffled with ``featcal.seed`` and cut); the :class:`~hf_featcal.FeatCalConfig` of the run then has
``num_samples_per_task=None``.

The package: `spec` (the spec dataclasses, `RecipeError`, `KeyChecker`), `parse` (YAML → `Recipe`),
`load` (datasets, evaluation), `preflight` (what `run`, `compare` and ``run --check`` check before the
merge) and `run` (the stages, the card, the upload).
"""

from __future__ import annotations

from ..schema import render_recipe_schema
from .load import (
    EVALUATION_SUBSET_SEED,
    check_family,
    evaluate_model,
    load_dataset_spec,
    model_family_of,
    prepare_calibration,
)
from .parse import (
    MERGE_PARAMETERS,
    Recipe,
    load_recipe,
    load_yaml,
    parse_calibration,
    parse_featcal,
    parse_recipe,
    validate_merge_spec,
)
from .preflight import check_recipe_inputs, check_recipe_targets
from .run import (
    CalibrationRun,
    RecipeInputs,
    RecipeResult,
    StepRun,
    build_calibrator,
    calibrate_merged,
    check_fast_mode,
    check_output_dir,
    lm_eval_table,
    load_calibration_data,
    merge_experts,
    post_merge,
    prepare_recipe_inputs,
    push_run,
    recipe_evaluator,
    recipe_input_folders,
    run_recipe,
    save_calibrated,
    save_run,
    save_step_run,
    upload_folder,
)
from .spec import CompareSpec, DatasetSpec, EvaluationSpec, KeyChecker, MergeSpec, RecipeError

if __doc__:  # the schema block, rendered from the declarations (absent under python -OO)
    __doc__ = __doc__.replace("    <recipe schema>", render_recipe_schema(indent=4))

__all__ = [
    "EVALUATION_SUBSET_SEED",
    "MERGE_PARAMETERS",
    "CalibrationRun",
    "CompareSpec",
    "DatasetSpec",
    "EvaluationSpec",
    "KeyChecker",
    "MergeSpec",
    "Recipe",
    "RecipeError",
    "RecipeInputs",
    "RecipeResult",
    "StepRun",
    "build_calibrator",
    "calibrate_merged",
    "check_family",
    "check_fast_mode",
    "check_output_dir",
    "check_recipe_inputs",
    "check_recipe_targets",
    "evaluate_model",
    "lm_eval_table",
    "load_calibration_data",
    "load_dataset_spec",
    "load_recipe",
    "load_yaml",
    "merge_experts",
    "model_family_of",
    "parse_calibration",
    "parse_featcal",
    "parse_recipe",
    "post_merge",
    "prepare_calibration",
    "prepare_recipe_inputs",
    "push_run",
    "recipe_evaluator",
    "recipe_input_folders",
    "run_recipe",
    "save_calibrated",
    "save_run",
    "save_step_run",
    "upload_folder",
    "validate_merge_spec",
]
