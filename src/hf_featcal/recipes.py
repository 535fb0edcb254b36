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
experts, calibration data and evaluation and ignores its ``merge`` section (list that method and its
parameters under ``compare.merges`` to have it in the grid). A method's parameters are laid over its
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
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .architectures import model_type_of
from .architectures.families import ModelFamily, detect_family, family_names, get_family, image_family_names, iter_families
from .config import FeatCalConfig
from .schema import (
    FAMILY_KEY_ATTRIBUTES,
    HUB_ID,
    MERGE_PARAMETER_DECLARATIONS,
    TASK,
    RecipeKey,
    check_integer,
    check_string,
    merge_parameters,
    recipe_key,
    recipe_keys,
    render_recipe_schema,
)

if __doc__:  # the schema block, rendered from the declarations (absent under python -OO)
    __doc__ = __doc__.replace("    <recipe schema>", render_recipe_schema(indent=4))

__all__ = [
    "EVALUATION_SUBSET_SEED",
    "IMAGE_FAMILIES",
    "MERGE_PARAMETERS",
    "MODEL_FAMILIES",
    "DatasetSpec",
    "EvaluationSpec",
    "MergeSpec",
    "CompareSpec",
    "Recipe",
    "RecipeError",
    "RecipeInputs",
    "RecipeResult",
    "CalibrationRun",
    "calibrate_merged",
    "check_fast_mode",
    "check_output_dir",
    "load_calibration_data",
    "merge_experts",
    "push_run",
    "recipe_input_folders",
    "save_run",
    "evaluate_model",
    "load_dataset_spec",
    "load_processing",
    "load_recipe",
    "load_yaml",
    "model_family_of",
    "parse_calibration",
    "parse_featcal",
    "parse_recipe",
    "prepare_calibration",
    "prepare_clip_calibration",
    "prepare_flan_t5_calibration",
    "prepare_recipe_inputs",
    "recipe_evaluator",
    "run_recipe",
    "build_calibrator",
    "save_calibrated",
    "save_processing",
    "scores_table",
    "upload_folder",
    "validate_merge_spec",
]

#: Supported model families (`hf_featcal.architectures.families`).
MODEL_FAMILIES: tuple[str, ...] = family_names()
#: Families calibrated on images and evaluated by zero-shot classification.
IMAGE_FAMILIES: tuple[str, ...] = image_family_names()

#: Seed of the random subset evaluated when ``evaluation.max_samples`` cuts a split.
EVALUATION_SUBSET_SEED = 0
_CALIBRATION_DATA = recipe_keys("calibration.default")
_DEFAULT_NUM_EXAMPLES: int = _CALIBRATION_DATA["num_examples"].default
_HUB_ID = HUB_ID
#: Kinds of value a `RecipeKey.check` checks (the rest are checked by the section's parser).
_SCALAR_KINDS = ("choice", "int", "str", "folder", "repo_id")


def _check_family_keys() -> None:
    """Every key a model family takes is a declared key (run at import)."""
    for family in iter_families():
        for section, attribute in FAMILY_KEY_ATTRIBUTES.items():
            undeclared = [k for k in getattr(family, attribute) if k not in recipe_keys(section)]
            if undeclared:
                raise RuntimeError(f"model family {family.name!r}: {attribute} {undeclared} are not declared in "
                                   f"hf_featcal.schema.RECIPE_SECTIONS[{section!r}]")


_check_family_keys()


class RecipeError(ValueError):
    """An invalid recipe. ``key`` is the offending key path (e.g. ``"merge.density"``)."""

    def __init__(self, key: str, message: str, source: str | None = None) -> None:
        self.key = key
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}" if key else f"{where}{message}")


# ====================================================================================== schema
@dataclass
class MergeSpec:
    """How the experts are merged: ``merge_models(base, experts, method, **params)``."""

    method: str
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """E.g. ``"task_arithmetic (scaling_factor=0.3)"``."""
        if not self.params:
            return self.method
        return f"{self.method} (" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


@dataclass
class DatasetSpec:
    """Where one task's data come from and how they are prepared.

    Attributes:
        dataset: hub id, or local folder written by ``Dataset.save_to_disk`` (``is_local``).
        config: dataset config name (hub datasets only; ignored for local folders).
        split: split name (for a local ``DatasetDict``, the key; a local ``Dataset`` is used whole).
        num_examples: examples used (shuffled with the FeatCal seed, then cut); None: all.
        image_column: CLIP: the image column (renamed to ``image``; default: ``image`` / ``img``).
        label_column: CLIP evaluation: the label column (renamed to ``label``).
        glue_task: FLAN-T5: the GLUE task whose prompt format is applied.
        max_input_length, max_target_length: FLAN-T5: token truncation lengths.
    """

    dataset: str
    config: str | None = None
    split: str = _CALIBRATION_DATA["split"].default
    num_examples: int | None = _DEFAULT_NUM_EXAMPLES
    is_local: bool = False
    image_column: str | None = None
    label_column: str | None = None
    glue_task: str | None = None
    max_input_length: int | None = _CALIBRATION_DATA["max_input_length"].default
    max_target_length: int | None = _CALIBRATION_DATA["max_target_length"].default


@dataclass
class EvaluationSpec:
    """What is evaluated before and after calibration."""

    tasks: list[str]
    datasets: dict[str, DatasetSpec]
    max_samples: int | None = None
    batch_size: int = 64
    class_names: dict[str, list[str]] = field(default_factory=dict)
    templates: dict[str, list[str]] = field(default_factory=dict)
    clip_model: str | None = None


@dataclass
class CompareSpec:
    """The grid of `hf-featcal compare RECIPE`: method → parameters, and the post-merging steps
    (None: every step `hf_featcal.compare.post_merging_steps` offers)."""

    merges: dict[str, dict[str, Any]]
    post_merging: list[str] | None = None


@dataclass
class Recipe:
    """A validated recipe (see the module docstring for the YAML schema)."""

    model_family: str
    base: str
    experts: dict[str, str]
    merge: MergeSpec
    featcal: FeatCalConfig
    calibration: dict[str, DatasetSpec]
    evaluation: EvaluationSpec | None
    output_dir: str
    push_to_hub: str | None = None
    source: str | None = None
    overwrite: bool = False
    private: bool | None = None
    compare: CompareSpec | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the recipe as given

    @property
    def family(self) -> ModelFamily:
        """The `ModelFamily` of ``model_family``."""
        return get_family(self.model_family)

    @property
    def tasks(self) -> list[str]:
        """Expert task names, in recipe order."""
        return list(self.experts)

    def to_dict(self) -> dict[str, Any]:
        """The recipe fully resolved (absolute local paths, every per-task dataset spelled out): it
        validates to the same recipe from any working directory."""

        family = self.family

        def data(spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
            out: dict[str, Any] = {"dataset": spec.dataset}
            if spec.config is not None:
                out["config"] = spec.config
            out["split"] = spec.split
            if calibration:
                out["num_examples"] = spec.num_examples
            out.update(family.dataset_to_dict(spec, calibration))
            return out

        featcal = {k: v for k, v in self.featcal.to_dict().items() if k != "num_samples_per_task"}
        result: dict[str, Any] = {
            "model_family": self.model_family,
            "base": self.base,
            "experts": dict(self.experts),
            "merge": {"method": self.merge.method, **self.merge.params},
            "featcal": featcal,
            "calibration": {"tasks": {t: data(s, True) for t, s in self.calibration.items()}},
        }
        if self.evaluation is None:
            result["evaluation"] = False
        else:
            ev = self.evaluation
            evaluation: dict[str, Any] = {
                "tasks": list(ev.tasks),
                "max_samples": ev.max_samples,
                "batch_size": ev.batch_size,
                "datasets": {t: data(s, False) for t, s in ev.datasets.items()},
            }
            evaluation.update(family.evaluation_to_dict(ev))
            result["evaluation"] = evaluation
        result["output_dir"] = os.path.abspath(self.output_dir)
        result["push_to_hub"] = self.push_to_hub
        result["private"] = self.private
        result["overwrite"] = self.overwrite
        if self.compare is not None:
            result["compare"] = {"merges": copy.deepcopy(self.compare.merges)}
            if self.compare.post_merging is not None:
                result["compare"]["post_merging"] = list(self.compare.post_merging)
        return result


# ================================================================================= validation
def load_recipe(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read and validate a YAML recipe (``yaml.safe_load``: plain data only). Nothing is downloaded.

    Args:
        path: the recipe file.
        overrides: top-level keys replacing the file's (e.g. ``{"output_dir": "out"}``).

    Raises:
        RecipeError: naming the offending key path; also for an unreadable or non-YAML file.
    """
    import yaml

    path = os.fspath(path)
    if os.path.isdir(path):
        raise RecipeError("", f"recipe file {path!r} is a folder, not a YAML file", None)
    if not os.path.isfile(path):
        raise RecipeError("", f"recipe file {path!r} does not exist", None)
    try:
        with open(path, encoding="utf-8") as handle:
            data = load_yaml(handle)
    except yaml.YAMLError as err:
        raise RecipeError("", f"not valid YAML: {err}", path) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError("", f"cannot read the recipe file: {err}", path) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError("", f"a recipe must be a YAML mapping, got {type(data).__name__}", path)
    data = dict(data)
    for key, value in (overrides or {}).items():
        data[key] = value
    default_output = os.path.join("outputs", Path(path).stem)
    return parse_recipe(data, base_dir=os.path.dirname(os.path.abspath(path)), source=path, default_output_dir=default_output)


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` (plain data only) that refuses a key given twice in one mapping, which
    ``safe_load`` resolves silently to the last value: a `yaml.YAMLError` naming the key and both lines."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                first_line: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` keys may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        if key in first_line:
                            raise yaml.constructor.ConstructorError(
                                None, None, f"duplicate key {key!r} on line {line} (first given on line "
                                f"{first_line[key]})", key_node.start_mark)
                        first_line[key] = line
                    except TypeError:  # an unhashable key: safe_load's own error follows
                        continue
            return super().construct_mapping(node, deep=deep)

    return yaml.load(stream, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_recipe(
    data: Mapping[str, Any],
    *,
    base_dir: str | os.PathLike | None = None,
    source: str | None = None,
    default_output_dir: str = os.path.join("outputs", "featcal"),
) -> Recipe:
    """Validate a recipe given as a dict (as ``yaml.safe_load`` returns it). Nothing is downloaded.

    Args:
        data: the recipe.
        base_dir: folder that relative input paths are looked up in first (default: the working
            directory).
        source: shown in error messages (the recipe file).
        default_output_dir: ``output_dir`` when the recipe has none.

    Raises:
        RecipeError: naming the offending key path.
    """
    v = _Validator(source, os.fspath(base_dir) if base_dir is not None else os.getcwd())
    if not isinstance(data, Mapping):
        raise v.error("", f"a recipe must be a mapping, got {type(data).__name__}")
    v.section(data, "")

    family = v.checked("model_family", data["model_family"])
    base = v.source(data["base"], "base", kind="model")
    experts_raw = data["experts"]
    if not isinstance(experts_raw, Mapping) or not experts_raw:
        raise v.error("experts", "must be a non-empty mapping task name -> hub id or local path")
    experts: dict[str, str] = {}
    for task, value in experts_raw.items():
        v.task_name(task, "experts")
        experts[task] = v.source(value, f"experts.{task}", kind="model")
    tasks = list(experts)  # for flan_t5, GLUE task names are checked per calibration entry

    merge = _parse_merge(v, data["merge"])
    featcal_section = data.get("featcal")
    if featcal_section is None:
        featcal_section = {}
    featcal = parse_featcal(v, featcal_section, "featcal")
    explicit_samples = isinstance(featcal_section, Mapping) and "num_samples_per_task" in featcal_section
    default_num = featcal.num_samples_per_task if explicit_samples else recipe_key("calibration.default.num_examples").default
    featcal = dataclasses.replace(featcal, num_samples_per_task=None)

    calibration = parse_calibration(v, data["calibration"], family, tasks, default_num)

    evaluation_raw = data.get("evaluation", {})
    evaluation = None if evaluation_raw is False else _parse_evaluation(v, evaluation_raw, family, tasks, calibration)

    output_dir = os.path.expanduser(v.checked("output_dir", data.get("output_dir") or default_output_dir))
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise v.error("output_dir", f"{output_dir!r} exists and is not a folder")
    push = v.checked("push_to_hub", data.get("push_to_hub"))
    private = v.checked("private", data.get("private"))
    overwrite = v.checked("overwrite", data.get("overwrite", False))
    compare = _parse_compare(v, data["compare"]) if data.get("compare") is not None else None
    return Recipe(
        model_family=family,
        base=base,
        experts=experts,
        merge=merge,
        featcal=featcal,
        calibration=calibration,
        evaluation=evaluation,
        output_dir=output_dir,
        push_to_hub=push,
        source=source,
        overwrite=overwrite,
        private=private,
        compare=compare,
        raw=copy.deepcopy(dict(data)),
    )


class _Validator:
    """Small helpers that raise `RecipeError`s naming the key path."""

    def __init__(self, source: str | None, base_dir: str) -> None:
        self.source_name = source
        self.base_dir = base_dir

    def error(self, key: str, message: str) -> RecipeError:
        return RecipeError(key, message, self.source_name)

    def section(self, section: Any, path: str) -> None:
        """`section` is a mapping of the keys `hf_featcal.schema.RECIPE_SECTIONS` declares at `path`,
        with its required ones."""
        declared = recipe_keys(path)
        self.keys(section, path, tuple(declared), tuple(k for k, d in declared.items() if d.required))

    def checked(self, path: str, value: Any, declared: RecipeKey | None = None, optional: bool | None = None) -> Any:
        """`value` checked by the declaration of `path` (or `declared`), errors naming `path`."""
        try:
            return (declared or recipe_key(path)).check(value, optional)
        except ValueError as err:
            raise self.error(path, str(err)) from None

    def keys(self, section: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
        if not isinstance(section, Mapping):
            raise self.error(path, f"must be a mapping, got {_show(section)}")
        for key in section:
            if key not in allowed:
                raise self.error(_join(path, str(key)), f"unknown key; valid keys here: {list(allowed)}")
        for key in required:
            if key not in section or section[key] is None:
                raise self.error(_join(path, key), "is required")

    def task_name(self, task: Any, path: str) -> None:
        if not isinstance(task, str) or not task.strip():
            raise self.error(f"{path}.{task}", f"task names must be non-empty strings, got {task!r}")

    def source(self, value: Any, path: str, kind: str) -> str:
        """A hub id or an existing local path (returned absolute); open_clip's `hf-hub:<hub id>` and
        `local-dir:<path>` references keep their scheme."""
        if isinstance(value, str) and value.startswith(("hf-hub:", "local-dir:")):
            scheme, _, rest = value.partition(":")
            if scheme == "local-dir":
                local = self.local_path(rest, path, kind)
                if local is None:
                    raise self.error(path, f"local {kind} path {rest!r} does not exist")
                return f"local-dir:{local}"
            if not _HUB_ID.match(rest) or ".." in rest:
                raise self.error(path, f"{rest!r} is not a valid hub id")
            return value
        local = self.local_path(value, path, kind)
        return local if local is not None else value

    def local_path(self, value: Any, path: str, kind: str) -> str | None:
        """The absolute local path `value` names, or None when it is a hub id."""
        if not isinstance(value, str) or not value.strip():
            raise self.error(path, f"must be a string (a hub id or a local {kind} path), got {_show(value)}")
        expanded = os.path.expanduser(value)
        explicit_local = os.path.isabs(expanded) or value.startswith(("./", "../", "~", ".\\", "..\\"))
        candidates = [expanded] if os.path.isabs(expanded) else [os.path.join(self.base_dir, expanded), expanded]
        for candidate in candidates:
            if os.path.exists(candidate):
                return os.path.abspath(candidate)
        if explicit_local:
            raise self.error(path, f"local {kind} path {value!r} does not exist")
        if not _HUB_ID.match(value) or ".." in value:
            raise self.error(path, f"{value!r} is neither an existing local path nor a valid hub id")
        return None

    def integer(self, value: Any, path: str, minimum: int | None = None, optional: bool = False) -> int | None:
        try:
            return check_integer(value, minimum, optional)
        except ValueError as err:
            raise self.error(path, str(err)) from None

    def string(self, value: Any, path: str, optional: bool = False) -> str | None:
        try:
            return check_string(value, optional)
        except ValueError as err:
            raise self.error(path, str(err)) from None

    def string_list(self, value: Any, path: str) -> list[str]:
        if not isinstance(value, list) or not value:
            raise self.error(path, f"must be a non-empty list of strings, got {_show(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise self.error(f"{path}[{i}]", f"must be a non-empty string, got {_show(item)}")
        return list(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# ---------------------------------------------------------------------------------- merge
#: Merge methods of recipes and the parameters each takes, from the declarations in
#: `hf_featcal.schema` (which `hf_featcal.merging` checks against its functions).
MERGE_PARAMETERS: dict[str, tuple[str, ...]] = {
    method: tuple(p.name for p in declared) for method, declared in MERGE_PARAMETER_DECLARATIONS.items()
}


def _parse_merge(v: _Validator, section: Any) -> MergeSpec:
    if not isinstance(section, Mapping):
        raise v.error("merge", f"must be a mapping with a `method`, got {_show(section)}")
    method = section.get("method")
    return validate_merge_spec(method, {k: val for k, val in section.items() if k != "method"}, v)


def validate_merge_spec(method: str, params: Mapping[str, Any], validator: Any = None) -> MergeSpec:
    """Check a merge method and its parameters (also used by the CLI); returns a `MergeSpec`.

    Raises:
        RecipeError: naming ``merge.method`` or ``merge.<param>``.
    """
    v = validator if isinstance(validator, _Validator) else _Validator(None, os.getcwd())
    if method not in MERGE_PARAMETER_DECLARATIONS:
        raise v.error("merge.method", f"must be one of {list(MERGE_PARAMETER_DECLARATIONS)}, got {method!r}")
    declared = merge_parameters(method)
    out = {}
    for key, value in params.items():
        if key not in declared:
            raise v.error(f"merge.{key}", f"unknown parameter for method {method!r}; valid: {list(declared) or 'none'}")
        try:
            out[key] = declared[key].check(value)
        except ValueError as err:
            raise v.error(f"merge.{key}", str(err)) from None
    return MergeSpec(method, out)


# -------------------------------------------------------------------------------- compare
def _parse_compare(v: _Validator, section: Any) -> CompareSpec:
    """The ``compare`` section: method names, parameter names and values are checked against their
    declarations (as `hf_featcal.compare.check_merges` checks them); post-merging steps must be offered."""
    from .compare import DEFAULT_MERGES, grid_merge_parameters, post_merging_steps

    v.section(section, "compare")
    merges: dict[str, dict[str, Any]] = {}
    raw = section.get("merges")
    if raw is None:
        merges = copy.deepcopy(DEFAULT_MERGES)
    else:
        if not isinstance(raw, Mapping) or not raw:
            raise v.error("compare.merges", f"must be a non-empty mapping method -> parameters (or null), got {_show(raw)}")
        for method, params in raw.items():
            path = f"compare.merges.{method}"
            if method not in DEFAULT_MERGES:
                raise v.error(path, f"unknown merge method; valid: {list(DEFAULT_MERGES)}")
            params = {} if params is None else params
            if not isinstance(params, Mapping):
                raise v.error(path, f"must be a mapping of parameters or null, got {_show(params)}")
            declared = grid_merge_parameters(method)
            checked = {}
            for key, value in params.items():
                if key not in declared:
                    raise v.error(f"{path}.{key}", f"unknown parameter for method {method!r}; valid: {list(declared) or 'none'}")
                try:
                    checked[key] = declared[key].check(value)
                except ValueError as err:
                    raise v.error(f"{path}.{key}", str(err)) from None
            merges[method] = {**DEFAULT_MERGES[method], **checked}
    steps = section.get("post_merging")
    if steps is not None:
        steps = v.string_list(steps, "compare.post_merging")
        offered = post_merging_steps()
        for i, step in enumerate(steps):
            if step not in offered:
                raise v.error(f"compare.post_merging[{i}]", f"unknown post-merging step {step!r}; this build offers {list(offered)}")
            if step in steps[:i]:
                raise v.error(f"compare.post_merging[{i}]", f"step {step!r} is listed twice")
    return CompareSpec(merges=merges, post_merging=steps)


# -------------------------------------------------------------------------------- featcal
def parse_featcal(v: _Validator | None, section: Any, path: str = "featcal") -> FeatCalConfig:
    """A `FeatCalConfig` from a mapping; errors name ``featcal.<field>``."""
    v = v or _Validator(None, os.getcwd())
    if not isinstance(section, Mapping):
        raise v.error(path, f"must be a mapping of FeatCalConfig fields, got {_show(section)}")
    fields = [f.name for f in dataclasses.fields(FeatCalConfig)]
    for key in section:
        if key not in fields:
            raise v.error(f"{path}.{key}", f"unknown FeatCalConfig field; valid: {fields}")
    # Field by field first (every other field at its default), so that an error belongs to the key
    # that caused it; then all together.
    for key, value in section.items():
        try:
            FeatCalConfig(**{key: value})
        except (ValueError, TypeError) as err:
            raise v.error(f"{path}.{key}", str(err)) from None
    try:
        return FeatCalConfig(**dict(section))
    except (ValueError, TypeError) as err:
        raise v.error(path, str(err)) from None


# ---------------------------------------------------------------------------- calibration
#: Calibration data keys every family takes (the others belong to the families that list them).
_COMMON_DATA_KEYS = tuple(k for k in _CALIBRATION_DATA if not any(k in f.calibration_data_keys for f in iter_families()))


def parse_calibration(
    v: _Validator | None,
    section: Any,
    family: str,
    tasks: list[str],
    default_num_examples: int | None = _DEFAULT_NUM_EXAMPLES,
) -> dict[str, DatasetSpec]:
    """Per-task calibration `DatasetSpec`s from a recipe's ``calibration`` section."""
    v = v or _Validator(None, os.getcwd())
    v.section(section, "calibration")
    allowed = _COMMON_DATA_KEYS + get_family(family).calibration_data_keys
    default = section.get("default") or {}
    _check_entry_keys(v, default, "calibration.default", allowed, family)
    per_task = section.get("tasks") or {}
    if not isinstance(per_task, Mapping):
        raise v.error("calibration.tasks", f"must be a mapping task -> dataset, got {_show(per_task)}")
    for task in per_task:
        if task not in tasks:
            raise v.error(f"calibration.tasks.{task}", f"no expert is named {task!r}; experts: {tasks}")
    specs: dict[str, DatasetSpec] = {}
    for task in tasks:
        entry = per_task.get(task)
        path = f"calibration.tasks.{task}"
        if isinstance(entry, str):
            entry = {"dataset": entry}
        elif entry is None:
            entry = {}
        _check_entry_keys(v, entry, path, allowed, family)
        merged = {**default, **entry}
        if "dataset" not in merged or merged["dataset"] is None:
            raise v.error(path, f"no calibration dataset for expert {task!r}: give {path} or calibration.default.dataset")
        keys = {k: (f"{path}.{k}" if k in entry else f"calibration.default.{k}") for k in merged}
        specs[task] = _dataset_spec(v, task, merged, keys, path, family, default_split=recipe_key("calibration.default.split").default,
                                    default_num=default_num_examples, section="calibration.default")
    return specs


def _check_entry_keys(v: _Validator, entry: Any, path: str, allowed: tuple[str, ...], family: str) -> None:
    if not isinstance(entry, Mapping):
        raise v.error(path, f"must be a dataset (hub id or path) or a mapping, got {_show(entry)}")
    for key in entry:
        owners = [f.name for f in iter_families() if key in f.calibration_data_keys]
        if owners and key not in allowed:
            shown = " / ".join(repr(f) for f in owners)
            raise v.error(f"{path}.{key}", f"only for model_family {shown} (this recipe is {family!r})")
        if key not in allowed:
            raise v.error(f"{path}.{key}", f"unknown key; valid keys here: {list(allowed)}")


def _dataset_spec(
    v: _Validator,
    task: str,
    entry: Mapping[str, Any],
    keys: Mapping[str, str],
    fallback: str,
    family: str,
    default_split: str | None,
    default_num: int | None,
    section: str,
) -> DatasetSpec:
    """A `DatasetSpec` from a (merged) entry of the declared `section`; `keys` maps a field to its key
    path in the recipe (fields not in it are reported under `fallback`)."""

    def sub(value: Any) -> Any:
        return value.replace("{task}", task) if isinstance(value, str) else value

    def key(name: str) -> str:
        return keys.get(name, f"{fallback}.{name}")

    model_family = get_family(family)
    declared = recipe_keys(section)
    # the declared defaults of the family's own keys (e.g. flan_t5's max_input_length), then every
    # declared scalar checked by its declaration (split and num_examples below: whether a split may be
    # null depends on the family, and num_examples falls back to the run's default)
    entry = {**{name: d.default for name, d in declared.items() if name in model_family.calibration_data_keys
                and d.default is not None}, **entry}
    for name, value in entry.items():
        if name in declared and declared[name].kind in _SCALAR_KINDS and name not in ("split", "num_examples"):
            v.checked(key(name), sub(value), declared[name])
    dataset = sub(entry["dataset"])
    local = v.local_path(dataset, key("dataset"), "dataset")
    config = sub(entry.get("config"))
    split = v.checked(key("split"), sub(entry.get("split", default_split)), declared["split"],
                      optional=model_family.split_optional)
    num = v.checked(key("num_examples"), entry.get("num_examples", default_num), recipe_key("calibration.default.num_examples"))
    if local is not None and split is not None:
        splits = _local_splits(local)
        if splits is not None and split not in splits:
            raise v.error(key("split"), f"the local DatasetDict {local!r} has no split {split!r} (it has {splits})")
    spec = DatasetSpec(
        dataset=local or dataset,
        config=config,
        split=split,  # type: ignore[arg-type]
        num_examples=num,
        is_local=local is not None,
    )
    model_family.complete_dataset_spec(v, task, spec, entry, key, sub, keys, fallback)
    return spec


def _local_splits(path: str) -> list[str] | None:
    """The splits of a local ``DatasetDict`` folder (from its ``dataset_dict.json``), None for a
    single ``Dataset`` folder (or anything else)."""
    file = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as handle:
            return list(json.load(handle).get("splits", []))
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- evaluation
#: Evaluation keys only some families take (`ModelFamily.evaluation_keys`).
_FAMILY_EVALUATION_KEYS = tuple(k for k in recipe_keys("evaluation") if any(k in f.evaluation_keys for f in iter_families()))


def _parse_evaluation(
    v: _Validator, section: Any, family: str, tasks: list[str], calibration: Mapping[str, DatasetSpec]
) -> EvaluationSpec:
    if section is True or section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise v.error("evaluation", f"must be a mapping or false, got {_show(section)}")
    v.section(section, "evaluation")
    model_family = get_family(family)
    for key in _FAMILY_EVALUATION_KEYS:
        if key in section and key not in model_family.evaluation_keys:
            owners = " / ".join(repr(f.name) for f in iter_families() if key in f.evaluation_keys)
            raise v.error(f"evaluation.{key}", f"only for model_family {owners} (this recipe is {family!r})")
    eval_tasks = v.string_list(section["tasks"], "evaluation.tasks") if "tasks" in section else list(tasks)
    for i, task in enumerate(eval_tasks):
        if task not in tasks:
            raise v.error(f"evaluation.tasks[{i}]", f"no expert is named {task!r}; experts: {tasks}")
        if task in eval_tasks[:i]:
            raise v.error(f"evaluation.tasks[{i}]", f"task {task!r} is listed twice")

    split = section.get("split")
    if isinstance(split, Mapping):
        for task, value in split.items():
            if task not in eval_tasks:
                raise v.error(f"evaluation.split.{task}", f"{task!r} is not an evaluated task ({eval_tasks})")
            v.string(value, f"evaluation.split.{task}")
    elif split is not None:
        v.string(split, "evaluation.split")

    def per_task_mapping(name: str) -> Mapping[str, Any]:
        raw = section.get(name) or {}
        if not isinstance(raw, Mapping):
            raise v.error(f"evaluation.{name}", f"must be a mapping task -> value, got {_show(raw)}")
        for task in raw:
            if task not in eval_tasks:
                raise v.error(f"evaluation.{name}.{task}", f"{task!r} is not an evaluated task ({eval_tasks})")
        return raw

    datasets_raw = per_task_mapping("datasets")
    class_names = {t: v.string_list(n, f"evaluation.class_names.{t}") for t, n in per_task_mapping("class_names").items()}
    templates = {t: v.string_list(n, f"evaluation.templates.{t}") for t, n in per_task_mapping("templates").items()}

    specs: dict[str, DatasetSpec] = {}
    for task in eval_tasks:
        path = f"evaluation.datasets.{task}"
        entry = datasets_raw.get(task)
        cal = calibration[task]
        if isinstance(entry, str):
            entry = {"dataset": entry}
        if entry is None:
            entry, keys = {"dataset": cal.dataset, "config": cal.config}, {}
        else:
            required = tuple(k for k, d in recipe_keys(f"evaluation.datasets.{TASK}").items() if d.required)
            v.keys(entry, path, model_family.evaluation_data_keys, required)
            entry, keys = dict(entry), {k: f"{path}.{k}" for k in entry}
        if "split" not in entry:
            if isinstance(split, Mapping) and task in split:
                entry["split"], keys["split"] = split[task], f"evaluation.split.{task}"
            elif isinstance(split, str):
                entry["split"], keys["split"] = split, "evaluation.split"
            else:
                entry["split"] = model_family.default_evaluation_split(cal.glue_task or task)
        model_family.inherit_from_calibration(entry, cal)
        spec = _dataset_spec(v, task, entry, keys, path, family, default_split=None, default_num=None,
                             section=f"evaluation.datasets.{TASK}")
        model_family.finish_evaluation_spec(v, spec, entry, path)
        specs[task] = spec
        if spec.dataset == cal.dataset and spec.config == cal.config:
            if spec.is_local and _local_splits(spec.dataset) is None:
                raise v.error(
                    path,
                    f"evaluation would read the same local Dataset as calibration ({cal.dataset!r}); save a "
                    "DatasetDict with separate splits or give a separate evaluation dataset here",
                )
            if spec.split == cal.split:
                raise v.error(
                    keys.get("split", path),
                    f"task {task!r} would be evaluated on its calibration split {cal.split!r}; use a held-out split",
                )

    model_family.check_evaluation(v, eval_tasks, class_names, templates)

    max_samples = v.checked("evaluation.max_samples", section.get("max_samples"))
    batch_size = v.checked("evaluation.batch_size", section.get("batch_size", model_family.default_evaluation_batch_size))
    clip_model = section.get("clip_model")
    if clip_model is not None:
        clip_model = v.source(clip_model, "evaluation.clip_model", kind="model")
    return EvaluationSpec(
        tasks=eval_tasks,
        datasets=specs,
        max_samples=max_samples,
        batch_size=batch_size,  # type: ignore[arg-type]
        class_names=class_names,
        templates=templates,
        clip_model=clip_model,
    )


# ==================================================================================== loading
def load_dataset_spec(spec: DatasetSpec, *, what: str = "dataset") -> Any:
    """The ``datasets.Dataset`` a spec names: ``load_from_disk`` for a local folder (a
    ``DatasetDict`` gives its ``split``), else ``load_dataset(hub id, config, split=split)``."""
    import datasets as hf_datasets

    if spec.is_local:
        try:
            ds = hf_datasets.load_from_disk(spec.dataset)
        except Exception as err:  # noqa: BLE001 - datasets fails on an empty split with a bare IndexError
            raise ValueError(
                f"{what}: cannot load the local dataset {spec.dataset!r} (saved with Dataset.save_to_disk?; "
                f"an empty split cannot be loaded): {type(err).__name__}: {err}"
            ) from None
        if isinstance(ds, hf_datasets.DatasetDict):
            if spec.split not in ds:
                raise ValueError(f"{what}: the local DatasetDict {spec.dataset!r} has no split {spec.split!r} (it has {list(ds)})")
            ds = ds[spec.split]
        if len(ds) == 0:
            raise ValueError(f"{what}: the local dataset {spec.dataset!r} (split {spec.split!r}) has 0 rows")
        return ds
    ds = hf_datasets.load_dataset(spec.dataset, spec.config, split=spec.split)
    if len(ds) == 0:
        raise ValueError(f"{what}: the dataset {spec.dataset!r} (split {spec.split!r}) has 0 rows")
    return ds


def _select(ds: Any, num: int | None, seed: int) -> Any:
    if num is None or num >= len(ds):
        return ds.shuffle(seed=seed) if num is not None else ds
    return ds.shuffle(seed=seed).select(range(num))


def prepare_calibration(family: str, task: str, spec: DatasetSpec, processing: Mapping[str, Any] | None, seed: int) -> Any:
    """One task's calibration ``Dataset``: loaded, shuffled with `seed`, cut to ``spec.num_examples``
    and prepared the way the family's calibrator input needs (`ModelFamily.prepare_calibration`)."""
    ds = _select(load_dataset_spec(spec, what=f"calibration.tasks.{task}"), spec.num_examples, seed)
    return get_family(family).prepare_calibration(task, ds, spec, processing)


def prepare_clip_calibration(task: str, spec: DatasetSpec, seed: int) -> Any:
    """One CLIP task's calibration ``Dataset``: loaded, shuffled with `seed`, cut to
    ``spec.num_examples`` and reduced to one ``image`` column (processed per batch by the calibrator)."""
    return prepare_calibration("clip", task, spec, None, seed)


def prepare_flan_t5_calibration(task: str, spec: DatasetSpec, tokenizer: Any, seed: int) -> Any:
    """One FLAN-T5 task's calibration ``Dataset``: shuffled, cut, in the GLUE prompt format and
    tokenised (``input_ids``, ``attention_mask``, ``labels``)."""
    return prepare_calibration("flan_t5", task, spec, {"tokenizer": tokenizer}, seed)


def model_family_of(model_or_config: Any) -> str | None:
    """The name of the family (`hf_featcal.architectures.families`) of a model or config: ``"clip"`` /
    ``"flan_t5"`` from its ``model_type``, ``"open_clip"`` for an open_clip model; None if none."""
    family = detect_family(model_or_config)
    return None if family is None else family.name


def check_family(model: Any, family: str, argument: str) -> None:
    """Raise a ValueError when `model` is not of `family`."""
    found = model_family_of(model)
    if found != family:
        model_type = model_type_of(model)
        raise ValueError(f"{argument} has model_type {model_type!r}, which is not a {family!r} model")


def load_processing(family: str, source: str) -> dict[str, Any]:
    """The processing classes saved with `source` (`ModelFamily.load_processing`): for CLIP the image
    processor (``"image"``) and, when there is a tokenizer, a ``CLIPProcessor`` (``"processor"``); for
    FLAN-T5 the tokenizer; for open_clip the checkpoint's preprocess transform (``"image"``) and
    ``(tokenizer, preprocess)``."""
    return get_family(family).load_processing(source)


def calibration_processing_class(family: str, processing: Mapping[str, Any]) -> Any:
    """What the calibrator applies to raw rows: the image processor / transform (CLIP, open_clip) or
    the tokenizer (FLAN-T5)."""
    return get_family(family).calibration_processing_class(processing)


def save_processing(processing: Mapping[str, Any], output_dir: str) -> None:
    """Save the processing classes next to a model (so the folder loads as a complete model), the way
    `FeatCalCalibrator.save_model` saves them (`hf_featcal.saving`). open_clip keeps its preprocessing in
    `open_clip_config.json`, written with the model."""
    from .saving import processing_to_save, save_processing_class

    save_processing_class(processing_to_save(processing), output_dir)


# ================================================================================= evaluation
def evaluate_model(
    family: str,
    model: Any,
    spec: EvaluationSpec,
    *,
    processing: Mapping[str, Any],
    clip_model: Any = None,
    device: Any = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Score `model` on every task of `spec`; returns (task → headline score in [0, 1], details)."""
    model_family = get_family(family)
    scores: dict[str, float] = {}
    details: dict[str, Any] = {}
    for task in spec.tasks:
        data_spec = spec.datasets[task]
        ds = load_dataset_spec(data_spec, what=f"evaluation.datasets.{task}")
        if spec.max_samples is not None and len(ds) > spec.max_samples:
            # a seeded random subset: evaluation splits are often sorted by label
            ds = ds.shuffle(seed=EVALUATION_SUBSET_SEED).select(range(spec.max_samples))
        scores[task], details[task] = model_family.evaluate_task(
            model, task, ds, data_spec, spec, processing=processing, clip_model=clip_model, device=device
        )
    return scores, details


def scores_table(rows: Mapping[str, Mapping[str, float]], tasks: list[str], title: str = "model") -> str:
    """A markdown table, one row per model, one column per task plus the mean (in %)."""
    header = f"| {title} | " + " | ".join(tasks) + " | mean |"
    lines = [header, "|---|" + "---:|" * (len(tasks) + 1)]
    for name, scores in rows.items():
        cells = [f"{100 * scores[t]:.1f}" if t in scores else "–" for t in tasks]
        values = [scores[t] for t in tasks if t in scores]
        mean = f"{100 * sum(values) / len(values):.1f}" if values else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


# ======================================================================================= run
@dataclass
class RecipeInputs:
    """What a recipe run loads before merging: the base model, its processing classes, the text
    tower of zero-shot heads (CLIP; None when not evaluating or not needed) and task → prepared
    calibration ``Dataset``."""

    base: Any
    processing: dict[str, Any]
    clip_model: Any
    calibration: dict[str, Any]


def prepare_recipe_inputs(recipe: Recipe, *, evaluate: bool = True, log: Callable[[str], None] = print) -> RecipeInputs:
    """Load a recipe's base, processing classes, zero-shot text tower (when `evaluate` and the recipe
    evaluates) and calibration data — the steps `run_recipe` (and `hf-featcal compare RECIPE`) take
    before merging."""
    from .model_io import load_model

    family = recipe.model_family
    log(f"Loading the base model {recipe.base} ...")
    base = load_model(recipe.base, "base")
    check_family(base, family, "base")
    model_family = recipe.family
    processing = model_family.load_processing(recipe.base)
    clip_model = None
    if recipe.evaluation is not None and evaluate:  # the text tower of zero-shot heads, before merging
        clip_model, processing = model_family.recipe_text_model(base, recipe.evaluation, processing, load_model)

    calibration = load_calibration_data(family, recipe.calibration, processing, recipe.featcal.seed, log=log)
    return RecipeInputs(base=base, processing=processing, clip_model=clip_model, calibration=calibration)


def load_calibration_data(
    family: str,
    specs: Mapping[str, DatasetSpec],
    processing: Mapping[str, Any] | None,
    seed: int,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Stage *load*: task → calibration ``Dataset`` prepared for the family (`prepare_calibration`)."""
    log("Loading the calibration data ...")
    return {task: prepare_calibration(family, task, spec, processing, seed) for task, spec in specs.items()}


def recipe_evaluator(
    recipe: Recipe, inputs: RecipeInputs, device: Any = None
) -> Callable[..., tuple[dict[str, float], dict[str, Any]]]:
    """``evaluate(model, tasks=None)`` → (task → headline score in [0, 1], details): the recipe's
    evaluation (`evaluate_model`) on every evaluated task, or on `tasks` only."""
    if recipe.evaluation is None:
        raise RecipeError("evaluation", "is false; this needs the recipe's evaluation", recipe.source)
    spec = recipe.evaluation

    def evaluate(model: Any, tasks: list[str] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        chosen = spec if tasks is None else dataclasses.replace(spec, tasks=list(tasks))
        return evaluate_model(recipe.model_family, model, chosen, processing=inputs.processing,
                              clip_model=inputs.clip_model, device=device)

    return evaluate


@dataclass
class RecipeResult:
    """What `run_recipe` produced."""

    output_dir: str
    report: Any
    before: dict[str, float] | None
    after: dict[str, float] | None
    plot_path: str | None
    timings: dict[str, float]
    table: str | None
    pushed_to: str | None = None


# The stages of a run. `run_recipe` is their sequence; ``hf-featcal merge`` / ``calibrate`` build the
# same inputs from their flags and call the same stages (a given merged model replaces *merge*):
#   check_output_dir → prepare_recipe_inputs / load_calibration_data → merge_experts →
#   build_calibrator → calibrate_merged (evaluating before and after when asked) → save_run → push_run


def check_output_dir(
    output_dir: str,
    key: str = "output_dir",
    source: str | None = None,
    *,
    inputs: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    model_folder: bool = True,
) -> None:
    """Stage *check*: refuse, before anything is loaded, an output folder a save cannot go to
    (`hf_featcal.saving.check_output_dir`, the rule the save applies again): not writable, one of the
    run's `inputs` (or inside or around one), or non-empty and not an earlier save unless `overwrite`.
    `model_folder=False` (outputs that are not a model save, e.g. compare's tables): writability only.

    Raises:
        RecipeError: naming `key`.
    """
    from .saving import check_output_dir as check_save_folder
    from .saving import check_writable_folder

    try:
        if model_folder:
            check_save_folder(output_dir, key, inputs=inputs, overwrite=overwrite)
        else:
            check_writable_folder(output_dir, key)
    except (TypeError, ValueError) as err:
        raise RecipeError(key, str(err).split(" ", 1)[1], source) from None


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
    from .pipeline.checks import check_forward_dtype

    try:
        check_forward_dtype(recipe.featcal, {"base": base})
    except ValueError as err:
        raise RecipeError("featcal.forward_dtype", str(err), recipe.source) from None


def merge_experts(base: Any, experts: Mapping[str, Any], merge: MergeSpec, *, log: Callable[[str], None] = print) -> Any:
    """Stage *merge*: ``merge_models(base, experts, method, **params)`` of a validated `MergeSpec`."""
    from .merging import merge_models

    log(f"Merging {len(experts)} experts: {merge.describe()} ...")
    return merge_models(base, dict(experts), merge.method, **merge.params)


@dataclass
class CalibrationRun:
    """What `calibrate_merged` produced: the calibrator (its report, its ``save_model``), the calibrated
    model, the scores before / after (None when not evaluated), their details and the seconds per step."""

    calibrator: Any
    calibrated: Any
    before: dict[str, float] | None
    after: dict[str, float] | None
    details: dict[str, Any]
    timings: dict[str, float]


def calibrate_merged(
    calibrator: Any,
    merged: Any,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    evaluation: EvaluationSpec | None = None,
    clip_model: Any = None,
    log: Callable[[str], None] = print,
) -> CalibrationRun:
    """Stage *calibrate*: ``calibrator.calibrate()`` (a `build_calibrator` of `merged`, which checks the
    inputs first), with `evaluation` (if given) of the merged model before and of the calibrated model
    after, on the calibrator's device."""
    run_device = str(calibrator.device)
    timings: dict[str, float] = {}
    details: dict[str, Any] = {}

    def evaluate(model: Any, when: str, what: str) -> dict[str, float]:
        assert evaluation is not None
        clock = time.perf_counter()
        log(f"Evaluating the {what} model ...")
        scores, details[when] = evaluate_model(model_family.name, model, evaluation, processing=processing or {},
                                               clip_model=clip_model, device=run_device)
        timings[f"evaluate_{when}"] = time.perf_counter() - clock
        return scores

    before = evaluate(merged, "before", "merged") if evaluation is not None else None
    clock = time.perf_counter()
    log(f"Calibrating with FeatCal on {run_device} ...")
    calibrated = calibrator.calibrate()
    timings["calibrate"] = time.perf_counter() - clock
    after = evaluate(calibrated, "after", "calibrated") if evaluation is not None else None
    return CalibrationRun(calibrator=calibrator, calibrated=calibrated, before=before, after=after,
                          details=details, timings=timings)


def save_run(
    run: CalibrationRun,
    output_dir: str,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    recipe: Recipe | None = None,
    overwrite: bool = False,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[str | None, str | None]:
    """Stage *save*: one save (`hf_featcal.saving.atomic_folder`, one manifest) of the calibrated folder
    (`save_calibrated`'s files) and, with the run's `recipe`, the before / after table
    (``featcal_evaluation.json``, the model card's evaluation section) and the resolved recipe
    (``featcal_recipe.yaml``). `output_dir` is checked as the *check* stage does (`inputs`: the run's
    sources besides the calibrator's own; `overwrite`). Returns (drift plot path, scores table)."""
    import yaml

    from .saving import atomic_folder

    table = None
    if recipe is not None and recipe.evaluation is not None and run.before is not None and run.after is not None:
        rows = {recipe.merge.describe(): run.before, f"{recipe.merge.describe()} + FeatCal": run.after}
        table = scores_table(rows, recipe.evaluation.tasks)
    if not run.calibrator.state.is_main_process:
        return None, table
    with atomic_folder(output_dir, inputs={**run.calibrator.input_folders(), **(inputs or {})}, overwrite=overwrite) as folder:
        plot_name = _write_calibrated(run.calibrator, folder, model_family, processing)
        if table is not None:
            assert recipe is not None
            with open(os.path.join(folder, "featcal_evaluation.json"), "w", encoding="utf-8") as handle:
                json.dump({"before": run.before, "after": run.after, "details": run.details}, handle, indent=2, default=str)
                handle.write("\n")
            _append_to_card(folder, table, recipe)
        if recipe is not None:
            with open(os.path.join(folder, "featcal_recipe.yaml"), "w", encoding="utf-8") as handle:
                handle.write(f"# The recipe of this run (from {recipe.source or 'a dict'}), resolved: hf-featcal run <this file>\n")
                yaml.safe_dump(recipe.to_dict(), handle, sort_keys=False, allow_unicode=True)
    return (None if plot_name is None else os.path.join(output_dir, plot_name)), table


def push_run(
    output_dir: str, repo_id: str | None, *, private: bool | None = None, log: Callable[[str], None] = print
) -> str | None:
    """Stage *push*: upload exactly the files of the save in `output_dir` (its manifest's, local paths
    redacted: `upload_folder`) to `repo_id`, created `private` when asked; returns the repo id, None
    when `repo_id` is None."""
    if not repo_id:
        return None
    log(f"Uploading the saved files of {output_dir} to {repo_id} ...")
    upload_folder(output_dir, repo_id, private=private)
    return repo_id


def build_calibrator(
    merged: Any,
    base: Any,
    experts: Mapping[str, Any],
    calibration: Mapping[str, Any],
    config: FeatCalConfig,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    device: Any = None,
    show_progress: bool = True,
) -> Any:
    """Stage *build*: the `FeatCalCalibrator` of a run (checks its inputs before anything is computed),
    with the family's processing class for the calibration data; `calibrate_merged` runs it."""
    from .calibrator import FeatCalCalibrator

    return FeatCalCalibrator(
        merged, base, dict(experts), calibration, config,
        processing_class=model_family.calibration_processing_class(processing),
        device=device, show_progress=show_progress,
    )


def save_calibrated(
    calibrator: Any,
    output_dir: str,
    model_family: ModelFamily,
    processing: Mapping[str, Any] | None,
    *,
    overwrite: bool = False,
) -> str | None:
    """Save a calibrated run's folder (model, processing classes, card, drift report, config, drift
    plot) as one save (`hf_featcal.saving.atomic_folder`); returns the plot's path (None without a
    drift report)."""
    from .saving import atomic_folder

    if not calibrator.state.is_main_process:
        return None
    with atomic_folder(output_dir, inputs=calibrator.input_folders(), overwrite=overwrite) as folder:
        plot_name = _write_calibrated(calibrator, folder, model_family, processing)
    return None if plot_name is None else os.path.join(output_dir, plot_name)


def _write_calibrated(calibrator: Any, folder: str, model_family: ModelFamily, processing: Mapping[str, Any] | None) -> str | None:
    """`calibrator.write_model_folder` and the drift plot into `folder`; returns the plot's file name."""
    from .plotting import plot_drift

    calibrator.write_model_folder(folder, processing_class=model_family.processing_to_save(processing))
    if calibrator.report is None:
        return None
    plot_drift(calibrator.report, os.path.join(folder, "featcal_drift.png"))
    return "featcal_drift.png"


def run_recipe(
    recipe: Recipe,
    *,
    device: str | None = None,
    evaluate: bool = True,
    push_to_hub: bool = True,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
) -> RecipeResult:
    """Execute a recipe: merge → calibrate (checks first) → evaluate before/after → save (+ push), the
    stages `check_output_dir` → `prepare_recipe_inputs` → `merge_experts` → `build_calibrator` →
    `calibrate_merged` → `save_run` → `push_run`.

    The output folder gets the calibrated model (``save_pretrained``; open_clip: its own format), its
    processor / tokenizer,
    the model card (``README.md``, with the evaluation appended), ``featcal_drift_report.json``,
    ``featcal_config.json``, ``featcal_drift.png``, ``featcal_evaluation.json`` and the recipe
    (``featcal_recipe.yaml``).
    """
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    inputs_read = recipe_input_folders(recipe)
    check_output_dir(recipe.output_dir, "output_dir", recipe.source, inputs=inputs_read,
                     overwrite=recipe.overwrite)  # before anything is loaded or merged
    inputs = prepare_recipe_inputs(recipe, evaluate=evaluate, log=log)
    check_fast_mode(recipe, inputs.base)  # the merge is in the base's dtype
    timings["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    merged = merge_experts(inputs.base, recipe.experts, recipe.merge, log=log)
    timings["merge"] = time.perf_counter() - clock

    calibrator = build_calibrator(merged, inputs.base, recipe.experts, inputs.calibration, recipe.featcal, recipe.family,
                                  inputs.processing, device=device, show_progress=show_progress)
    run = calibrate_merged(calibrator, merged, recipe.family, inputs.processing,
                           evaluation=recipe.evaluation if evaluate else None, clip_model=inputs.clip_model, log=log)
    timings.update(run.timings)
    plot_path, table = save_run(run, recipe.output_dir, recipe.family, inputs.processing, recipe=recipe,
                                overwrite=recipe.overwrite, inputs=inputs_read)
    pushed = push_run(recipe.output_dir, recipe.push_to_hub if push_to_hub else None, private=recipe.private, log=log)
    return RecipeResult(
        output_dir=recipe.output_dir,
        report=run.calibrator.report,
        before=run.before,
        after=run.after,
        plot_path=plot_path,
        timings=timings,
        table=table,
        pushed_to=pushed,
    )


def _append_to_card(output_dir: str, table: str, recipe: Recipe) -> None:
    path = os.path.join(output_dir, "README.md")
    assert recipe.evaluation is not None
    splits = sorted({recipe.evaluation.datasets[t].split or "" for t in recipe.evaluation.tasks})
    limit = (f", seeded random subsets of at most {recipe.evaluation.max_samples} examples per task"
             if recipe.evaluation.max_samples else "")
    text = (
        f"\n## Evaluation\n\nHeadline score per task (%; split {', '.join(splits)}{limit}), "
        f"before and after FeatCal:\n\n{table}\n\n![feature drift per block](featcal_drift.png)\n"
    )
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def upload_folder(folder: str, repo_id: str, *, private: bool | None = None) -> Any:
    """Create (if needed) the hub model repo `repo_id` and upload exactly the files of the save in
    `folder` in one commit (`hf_featcal.saving.push_folder`: its manifest's files, local paths redacted;
    nothing else of the folder)."""
    from .saving import push_folder

    return push_folder(folder, repo_id, private=private)
