"""The pre-flight of a recipe: everything `run`, `compare` and ``run --check`` can check before the
merge, checked before the merge, with the same errors (`RecipeError` naming the key) for all of them.

Two parts:

- `check_recipe_targets`: what needs nothing loaded: the output folder (as the save will check it) and
  the push (a Hugging Face token; ``private`` into an existing public repository is refused,
  `hf_featcal.hub.check_push_target`).
- `check_recipe_inputs`: what the base and the data say, once they are loaded (`prepare_recipe_inputs`,
  which the run needs before merging anyway): the FeatCal module selection (``target_modules``,
  ``exclude_modules``, ``layers_to_transform``) resolved against the base's blocks, every calibration
  batch through the base's input path, and the number of ``evaluation.class_names`` against each
  evaluation dataset's labels. The merge has the base's architecture and shapes, so the calibrator's
  own construction checks, run on the base, refuse exactly what they would refuse on the merge.

`run_recipe` runs the first, loads the inputs (`prepare_recipe_inputs`) and runs the second; ``compare``
and ``run --check`` run the same two. This module also holds the checks they are made of that the stages
of `run` use: `check_output_dir`, `recipe_input_folders` and `check_fast_mode`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .parse import Recipe
from .spec import RecipeError

__all__ = [
    "check_fast_mode",
    "check_output_dir",
    "check_recipe_inputs",
    "check_recipe_targets",
    "recipe_input_folders",
    "recipe_sources_are_local",
    "recipe_writer",
]


def recipe_writer(recipe: Recipe) -> dict[str, str]:
    """What a run's save records of its writer (`hf_featcal.saving.atomic_folder`'s ``written_by``)."""
    return {"command": "hf-featcal run", "base": recipe.base}


def check_recipe_targets(recipe: Recipe, *, push: bool = True, model_folder: bool = True) -> None:
    """Refuse an output folder the save would refuse (`model_folder=False`: compare's tables and plots,
    writability only) and, when `push` and the recipe pushes, a push that cannot succeed."""
    check_output_dir(recipe.output_dir, "output_dir", recipe.source, inputs=recipe_input_folders(recipe),
                     overwrite=recipe.overwrite, model_folder=model_folder, written_by=recipe_writer(recipe))
    if push and recipe.push_to_hub:
        from ..hub import check_push_target

        try:
            check_push_target(recipe.push_to_hub, private=recipe.private, argument="push_to_hub")
        except ValueError as err:
            raise RecipeError("push_to_hub", str(err).split(": ", 1)[1], recipe.source) from None


def check_recipe_inputs(recipe: Recipe, inputs: Any, *, featcal: bool = True, evaluate: bool = True,
                        device: Any = None) -> None:
    """What the loaded base, processing classes and calibration data (`inputs`, a `RecipeInputs`) say
    about the run, before anything is merged: with `featcal`, the calibrator's construction checks on
    the base (module selection, batches; key ``featcal`` or ``calibration``); with `evaluate`, the class
    names of every evaluated task against its dataset's labels (key ``evaluation.class_names.<task>``);
    always, fast mode's dtype against the base's (`check_fast_mode`)."""
    check_fast_mode(recipe, inputs.base)  # the merge is in the base's dtype
    if featcal:
        _check_featcal_on_base(recipe, inputs, device)
    if evaluate and recipe.evaluation is not None and recipe.family.is_image:
        _check_class_names(recipe)


def _check_featcal_on_base(recipe: Recipe, inputs: Any, device: Any) -> None:
    from ..calibrator import FeatCalCalibrator

    base = inputs.base
    try:  # the base stands in for the merge and for every expert: the construction checks what the run's would
        FeatCalCalibrator(base, None, dict.fromkeys(inputs.calibration, base), inputs.calibration, recipe.featcal,
                          processing_class=recipe.family.calibration_processing_class(inputs.processing),
                          device=device, show_progress=False)
    except (ValueError, TypeError) as err:
        message = str(err)
        key = "calibration" if "calibration_data" in message else "featcal"
        raise RecipeError(key, f"{message} (found before merging: the merged model has the base's blocks)",
                          recipe.source) from None


def _check_class_names(recipe: Recipe) -> None:
    """Each zero-shot task's class names (the recipe's, else the built-in task's) number the classes of
    its evaluation dataset's ClassLabel (datasets without one are checked when scored)."""
    from ..evaluation.clip_zeroshot import resolve_clip_task
    from .load import load_dataset_spec

    evaluation = recipe.evaluation
    assert evaluation is not None
    for task in evaluation.tasks:
        spec = evaluation.datasets[task]
        names = evaluation.class_names.get(task)
        try:
            count = len(resolve_clip_task(task, names, argument="evaluation.class_names").class_names)
        except ValueError:
            continue  # not a zero-shot task this check knows: refused (or scored) where it is used
        dataset = load_dataset_spec(spec, what=f"evaluation.datasets.{task}")
        feature = dataset.features.get(spec.label_column or "label")
        classes = getattr(feature, "num_classes", None)
        if classes is not None and classes != count:
            where = "evaluation.class_names." + task if names is not None else f"evaluation.tasks ({task!r} built-in)"
            raise RecipeError(
                where, f"{count} class names, but the evaluation dataset {spec.dataset!r} (split {spec.split!r}) has "
                f"{classes} classes (ClassLabel {feature.names if hasattr(feature, 'names') else ''}); give one name "
                "per class, in label order", recipe.source,
            )


def recipe_sources_are_local(recipe: Recipe, evaluate: bool = True) -> bool:
    """Whether everything the pre-flight loads is local: the base, every calibration dataset and, when
    `evaluate`, the evaluation's datasets and CLIP model (``run --check`` loads them; it does not
    download)."""
    import os

    sources = [recipe.base]
    if evaluate and recipe.evaluation is not None and recipe.evaluation.clip_model:
        sources.append(recipe.evaluation.clip_model)
    specs = list(recipe.calibration.values())
    if evaluate and recipe.evaluation is not None:
        specs += [recipe.evaluation.datasets[t] for t in recipe.evaluation.tasks]
    return all(os.path.exists(s.removeprefix("local-dir:")) for s in sources) and all(s.is_local for s in specs)


def check_output_dir(
    output_dir: str,
    key: str = "output_dir",
    source: str | None = None,
    *,
    inputs: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    model_folder: bool = True,
    written_by: Mapping[str, str] | None = None,
) -> None:
    """Stage *check*: refuse, before anything is loaded, an output folder a save cannot go to
    (`hf_featcal.saving.check_output_dir`, the rule the save applies again): not writable, one of the
    run's `inputs` (or inside or around one), or non-empty and not an earlier save unless `overwrite`.
    `model_folder=False` (outputs that are not a model save, e.g. compare's tables): writability only.

    Raises:
        RecipeError: naming `key`.
    """
    from ..saving import FolderError, check_writable_folder
    from ..saving import check_output_dir as check_save_folder

    try:
        if model_folder:
            check_save_folder(output_dir, key, inputs=inputs, overwrite=overwrite, written_by=written_by)
        else:
            check_writable_folder(output_dir, key)
    except FolderError as err:
        raise RecipeError(key, err.reason, source) from None


def recipe_input_folders(recipe: Recipe) -> dict[str, str]:
    """Recipe key → local path of everything the run reads (base, experts, local datasets, the
    evaluation's CLIP model); hub ids are left out by `hf_featcal.saving.check_output_dir`."""
    folders = {"base": recipe.base, **{f"experts.{task}": path for task, path in recipe.experts.items()}}
    for task, spec in recipe.calibration.items():
        if spec.is_local:
            folders[f"calibration.tasks.{task}.dataset"] = spec.dataset
    if recipe.evaluation is not None:
        for task, spec in recipe.evaluation.datasets.items():
            if spec.is_local:
                folders[f"evaluation.datasets.{task}"] = spec.dataset
        if recipe.evaluation.clip_model:
            folders["evaluation.clip_model"] = recipe.evaluation.clip_model
    return folders


def check_fast_mode(recipe: Recipe, base: Any) -> None:
    """Refuse ``featcal.forward_dtype`` when it cannot run the (loaded) base's dtype, before merging.

    Raises:
        RecipeError: naming ``featcal.forward_dtype``.
    """
    from ..pipeline.checks import check_forward_dtype

    try:
        check_forward_dtype(recipe.featcal, {"base": base})
    except ValueError as err:
        raise RecipeError("featcal.forward_dtype", str(err), recipe.source) from None
