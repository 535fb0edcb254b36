"""Reading a recipe: YAML in, a validated `Recipe` out, before anything is downloaded. Every error is a
`RecipeError` naming the offending key path; the model family of the recipe (`hf_featcal.families`)
checks and fills its own keys.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import CHECKED_WITH, FeatCalConfig
from ..families import ModelFamily, get_family, iter_families, source_schemes
from ..merging import get_method, merge_methods, paper_defaults
from ..post_merging import get_step, step_names
from ..schema import (
    FAMILY_KEY_ATTRIBUTES,
    TASK,
    merge_parameters,
    recipe_key,
    recipe_keys,
)
from .spec import (
    DEFAULT_NUM_EXAMPLES,
    CompareSpec,
    DatasetSpec,
    EvaluationSpec,
    KeyChecker,
    MergeSpec,
    RecipeError,
    show,
)

__all__ = [
    "MERGE_PARAMETERS",
    "Recipe",
    "load_recipe",
    "load_yaml",
    "parse_calibration",
    "parse_featcal",
    "parse_recipe",
    "validate_merge_spec",
]

_CALIBRATION_DATA = recipe_keys("calibration.default")
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
    #: the post-merging step run on the merge (`hf_featcal.post_merging.recipe_step_names`) and the
    #: parameters given for it (laid over its declared defaults)
    post_merging: str = "featcal"
    post_merging_parameters: dict[str, Any] = field(default_factory=dict)
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
        if self.post_merging != "featcal":
            result["post_merging"] = ({self.post_merging: copy.deepcopy(self.post_merging_parameters)}
                                      if self.post_merging_parameters else self.post_merging)
        if self.compare is not None:
            result["compare"] = {"merges": copy.deepcopy(self.compare.merges)}
            if self.compare.post_merging is not None:
                parameters = self.compare.step_parameters
                result["compare"]["post_merging"] = (
                    {s: copy.deepcopy(parameters.get(s)) for s in self.compare.post_merging} if parameters
                    else list(self.compare.post_merging))
            if self.compare.samples is not None:
                result["compare"]["samples"] = list(self.compare.samples)
        return result


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
    return parse_recipe(data, base_dir=os.path.dirname(os.path.abspath(path)), source=path,
                        default_output_dir=default_output)


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

    return yaml.load(stream, Loader=UniqueKeyLoader)  # safe: a SafeLoader subclass


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
    v = KeyChecker(source, os.fspath(base_dir) if base_dir is not None else None, source_schemes())
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
    for task in featcal.task_weights or {}:
        if task not in tasks:
            raise v.error(f"featcal.task_weights.{task}", f"no expert is named {task!r}; experts: {tasks}")
    explicit_samples = isinstance(featcal_section, Mapping) and "num_samples_per_task" in featcal_section
    default_num = (featcal.num_samples_per_task if explicit_samples
                   else recipe_key("calibration.default.num_examples").default)
    featcal = dataclasses.replace(featcal, num_samples_per_task=None)

    calibration = parse_calibration(v, data["calibration"], family, tasks, default_num)

    evaluation_raw = data.get("evaluation", {} if get_family(family).evaluates else False)
    if evaluation_raw is not False and not get_family(family).evaluates:
        raise v.error("evaluation", f"model_family {family!r} has no built-in evaluation "
                      f"({get_family(family).no_evaluation_reason}); set evaluation: false or leave it out")
    evaluation = None if evaluation_raw is False else _parse_evaluation(v, evaluation_raw, family, tasks, calibration)

    output_dir = os.path.expanduser(v.checked("output_dir", data.get("output_dir") or default_output_dir))
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise v.error("output_dir", f"{output_dir!r} exists and is not a folder")
    push = v.checked("push_to_hub", data.get("push_to_hub"))
    private = v.checked("private", data.get("private"))
    overwrite = v.checked("overwrite", data.get("overwrite", False))
    compare = _parse_compare(v, data["compare"]) if data.get("compare") is not None else None
    step, step_parameters = _parse_run_step(v, data.get("post_merging"))
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
        post_merging=step,
        post_merging_parameters=step_parameters,
        raw=copy.deepcopy(dict(data)),
    )


def _parse_run_step(v: KeyChecker, raw: Any) -> tuple[str, dict[str, Any]]:
    """``post_merging``: a step of `recipe_step_names` (null: featcal), or a mapping of one such step to
    its parameters (checked by the step's declarations; null: its defaults)."""
    if raw is None:
        return "featcal", {}
    values: Any = None
    if isinstance(raw, Mapping):
        if len(raw) != 1:
            raise v.error("post_merging", f"a mapping names exactly one step and its parameters, got {show(raw)}")
        ((raw, values),) = raw.items()
        if values is not None and not isinstance(values, Mapping):
            raise v.error(f"post_merging.{raw}", f"must be a mapping of parameters or null, got {show(values)}")
    variant_fields = get_step(raw).featcal_fields if raw in step_names() else None
    if variant_fields:  # a FeatCal variant (FeatCal itself sets no field)
        fields = ", ".join(f"featcal.{name}" for name in variant_fields)
        raise v.error("post_merging", f"{raw!r} is FeatCal with other settings: leave post_merging at featcal and "
                      f"set {fields} in the featcal section")
    step = v.checked("post_merging", raw)
    try:
        parameters = get_step(step).checked_parameters(values)
    except ValueError as err:
        raise v.error(f"post_merging.{step}", str(err)) from None
    return step, parameters


# ---------------------------------------------------------------------------------- merge
#: Merge methods of recipes and the parameters each takes, from the merge-method registry (the methods
#: that need no calibration data).
MERGE_PARAMETERS: dict[str, tuple[str, ...]] = {
    method: tuple(p.name for p in declared.parameters)
    for method, declared in merge_methods(calibration_data=False).items()
}


def _parse_merge(v: KeyChecker, section: Any) -> MergeSpec:
    if not isinstance(section, Mapping):
        raise v.error("merge", f"must be a mapping with a `method`, got {show(section)}")
    method = section.get("method")
    return validate_merge_spec(method, {k: val for k, val in section.items() if k != "method"}, v)


def needs_data_reason(method: str) -> str:
    """Why a merge method that needs calibration data (RegMean, RegMean++) is not a merge step of its own,
    and where it runs."""
    return (f"{method!r} needs calibration data, which a merge on its own does not take: run it in the grid of "
            f"`hf-featcal compare RECIPE` (a recipe with a calibration section and compare: merges: "
            f"{{{method}: {{}}}}) or from Python: hf_featcal.merging.merge_models(base, experts, {method!r}, "
            "calibration_data=...)")


def validate_merge_spec(method: Any, params: Mapping[str, Any], validator: KeyChecker | None = None) -> MergeSpec:
    """Check a merge method and its parameters (also used by the CLI); returns a `MergeSpec`.

    Raises:
        RecipeError: naming ``merge.method`` or ``merge.<param>``.
    """
    v = validator if isinstance(validator, KeyChecker) else KeyChecker()
    offered = list(merge_methods(calibration_data=False))
    if method in merge_methods(calibration_data=True):
        raise v.error("merge.method", f"{needs_data_reason(method)}; a merge section takes one of {offered}")
    if method not in offered:
        raise v.error("merge.method", f"must be one of {offered}, got {method!r}")
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
def _parse_compare(v: KeyChecker, section: Any) -> CompareSpec:
    """The ``compare`` section: method names, parameter names and values are checked against their
    declarations (as `hf_featcal.compare.check_merges` checks them); post-merging steps must be offered."""
    v.section(section, "compare")
    merges: dict[str, dict[str, Any]] = {}
    defaults = paper_defaults()
    raw = section.get("merges")
    if raw is None:
        merges = defaults
    else:
        if not isinstance(raw, Mapping) or not raw:
            raise v.error("compare.merges",
                          f"must be a non-empty mapping method -> parameters (or null), got {show(raw)}")
        for method, params in raw.items():
            path = f"compare.merges.{method}"
            if method not in defaults:
                raise v.error(path, f"unknown merge method; valid: {list(defaults)}")
            params = {} if params is None else params
            if not isinstance(params, Mapping):
                raise v.error(path, f"must be a mapping of parameters or null, got {show(params)}")
            declared = get_method(method).declared()
            checked = {}
            for key, value in params.items():
                if key not in declared:
                    raise v.error(f"{path}.{key}",
                                  f"unknown parameter for method {method!r}; valid: {list(declared) or 'none'}")
                try:
                    checked[key] = declared[key].check(value)
                except ValueError as err:
                    raise v.error(f"{path}.{key}", str(err)) from None
            merges[method] = {**defaults[method], **checked}
    steps, step_parameters = _parse_post_merging(v, section.get("post_merging"))
    samples = section.get("samples")
    if samples is not None:
        if not isinstance(samples, list) or not samples:
            raise v.error("compare.samples", f"must be a non-empty list of integers ≥ 1 (or null), got {show(samples)}")
        for i, count in enumerate(samples):
            v.integer(count, f"compare.samples[{i}]", minimum=1)
            if count in samples[:i]:
                raise v.error(f"compare.samples[{i}]", f"{count} is listed twice")
    return CompareSpec(merges=merges, post_merging=steps, step_parameters=step_parameters, samples=samples)


def _parse_post_merging(v: KeyChecker, raw: Any) -> tuple[list[str] | None, dict[str, dict[str, Any]]]:
    """``compare.post_merging``: a list of registered steps, or a mapping step → parameters (checked by
    the step's declarations; null: its defaults). Returns the steps and the parameters given."""
    if raw is None:
        return None, {}
    offered = step_names()
    if isinstance(raw, Mapping):
        if not raw:
            raise v.error("compare.post_merging", "must not be empty")
        parameters: dict[str, dict[str, Any]] = {}
        for step, values in raw.items():
            path = f"compare.post_merging.{step}"
            if step not in offered:
                raise v.error(path, f"unknown post-merging step; this build offers {list(offered)}")
            if values is not None and not isinstance(values, Mapping):
                raise v.error(path, f"must be a mapping of parameters or null, got {show(values)}")
            try:
                checked = get_step(step).checked_parameters(values)
            except ValueError as err:
                raise v.error(path, str(err)) from None
            if checked:
                parameters[step] = checked
        return list(raw), parameters
    steps = v.string_list(raw, "compare.post_merging")
    for i, step in enumerate(steps):
        if step not in offered:
            raise v.error(f"compare.post_merging[{i}]",
                          f"unknown post-merging step {step!r}; this build offers {list(offered)}")
        if step in steps[:i]:
            raise v.error(f"compare.post_merging[{i}]", f"step {step!r} is listed twice")
    return steps, {}


# -------------------------------------------------------------------------------- featcal
def parse_featcal(v: KeyChecker | None, section: Any, path: str = "featcal") -> FeatCalConfig:
    """A `FeatCalConfig` from a mapping; errors name ``featcal.<field>``."""
    v = v or KeyChecker()
    if not isinstance(section, Mapping):
        raise v.error(path, f"must be a mapping of FeatCalConfig fields, got {show(section)}")
    fields = [f.name for f in dataclasses.fields(FeatCalConfig)]
    for key in section:
        if key not in fields:
            raise v.error(f"{path}.{key}", f"unknown FeatCalConfig field; valid: {fields}")
    # Field by field first (every other field at its default), so that an error belongs to the key
    # that caused it; then all together.
    for key, value in section.items():
        together = {name: section[name] for name in CHECKED_WITH.get(key, ()) if name in section}
        try:
            FeatCalConfig(**together, **{key: value})
        except (ValueError, TypeError) as err:
            raise v.error(f"{path}.{key}", str(err)) from None
    try:
        return FeatCalConfig(**dict(section))
    except (ValueError, TypeError) as err:
        raise v.error(path, str(err)) from None


# ---------------------------------------------------------------------------- calibration
#: Calibration data keys every family takes (the others belong to the families that list them).
_COMMON_DATA_KEYS = tuple(k for k in _CALIBRATION_DATA
                          if not any(k in f.calibration_data_keys for f in iter_families()))


def parse_calibration(
    v: KeyChecker | None,
    section: Any,
    family: str,
    tasks: list[str],
    default_num_examples: int | None = DEFAULT_NUM_EXAMPLES,
) -> dict[str, DatasetSpec]:
    """Per-task calibration `DatasetSpec`s from a recipe's ``calibration`` section."""
    v = v or KeyChecker()
    v.section(section, "calibration")
    allowed = _COMMON_DATA_KEYS + get_family(family).calibration_data_keys
    default = section.get("default") or {}
    _check_entry_keys(v, default, "calibration.default", allowed, family)
    per_task = section.get("tasks") or {}
    if not isinstance(per_task, Mapping):
        raise v.error("calibration.tasks", f"must be a mapping task -> dataset, got {show(per_task)}")
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
            raise v.error(path,
                          f"no calibration dataset for expert {task!r}: give {path} or calibration.default.dataset")
        keys = {k: (f"{path}.{k}" if k in entry else f"calibration.default.{k}") for k in merged}
        specs[task] = _dataset_spec(v, task, merged, keys, path, family,
                                    default_split=recipe_key("calibration.default.split").default,
                                    default_num=default_num_examples, section="calibration.default")
    return specs


def _check_entry_keys(v: KeyChecker, entry: Any, path: str, allowed: tuple[str, ...], family: str) -> None:
    if not isinstance(entry, Mapping):
        raise v.error(path, f"must be a dataset (hub id or path) or a mapping, got {show(entry)}")
    for key in entry:
        owners = [f.name for f in iter_families() if key in f.calibration_data_keys]
        if owners and key not in allowed:
            shown = " / ".join(repr(f) for f in owners)
            raise v.error(f"{path}.{key}", f"only for model_family {shown} (this recipe is {family!r})")
        if key not in allowed:
            raise v.error(f"{path}.{key}", f"unknown key; valid keys here: {list(allowed)}")


def _dataset_spec(
    v: KeyChecker,
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
    num = v.checked(key("num_examples"), entry.get("num_examples", default_num),
                    recipe_key("calibration.default.num_examples"))
    if local is not None and split is not None:
        splits = _local_splits(local)
        if splits is not None and split not in splits:
            raise v.error(key("split"), f"the local DatasetDict {local!r} has no split {split!r} (it has {splits})")
    spec = DatasetSpec(
        dataset=local or dataset,
        config=config,
        split=split,
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
_FAMILY_EVALUATION_KEYS = tuple(k for k in recipe_keys("evaluation")
                                if any(k in f.evaluation_keys for f in iter_families()))


def _parse_evaluation(  # noqa: C901 - one flat check per key of the evaluation section
    v: KeyChecker, section: Any, family: str, tasks: list[str], calibration: Mapping[str, DatasetSpec]
) -> EvaluationSpec:
    if section is True or section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise v.error("evaluation", f"must be a mapping or false, got {show(section)}")
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
            raise v.error(f"evaluation.{name}", f"must be a mapping task -> value, got {show(raw)}")
        for task in raw:
            if task not in eval_tasks:
                raise v.error(f"evaluation.{name}.{task}", f"{task!r} is not an evaluated task ({eval_tasks})")
        return raw

    datasets_raw = per_task_mapping("datasets")
    class_names = {t: v.string_list(n, f"evaluation.class_names.{t}")
                   for t, n in per_task_mapping("class_names").items()}
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
    batch_size = v.checked("evaluation.batch_size",
                           section.get("batch_size", model_family.default_evaluation_batch_size))
    clip_model = section.get("clip_model")
    if clip_model is not None:
        clip_model = v.source(clip_model, "evaluation.clip_model", kind="model")
    lm_eval_tasks = v.string_list(section["lm_eval_tasks"], "evaluation.lm_eval_tasks") if "lm_eval_tasks" in section \
        else []
    if lm_eval_tasks:
        from ..evaluation.lm_harness import LM_EVAL_INSTALL, lm_eval_installed

        if not lm_eval_installed():
            raise v.error("evaluation.lm_eval_tasks", f"needs lm-evaluation-harness, not installed: {LM_EVAL_INSTALL}")
    include_path = section.get("lm_eval_include_path")
    if include_path is not None:
        v.checked("evaluation.lm_eval_include_path", include_path)
        if not lm_eval_tasks:
            raise v.error("evaluation.lm_eval_include_path", "needs evaluation.lm_eval_tasks (the tasks it defines)")
        include_path = v.local_path(include_path, "evaluation.lm_eval_include_path", "folder")
        if include_path is None or not os.path.isdir(include_path):
            raise v.error("evaluation.lm_eval_include_path", "must be an existing local folder of task YAMLs")
    return EvaluationSpec(
        tasks=eval_tasks,
        datasets=specs,
        max_samples=max_samples,
        batch_size=batch_size,
        class_names=class_names,
        templates=templates,
        clip_model=clip_model,
        lm_eval_tasks=lm_eval_tasks,
        lm_eval_include_path=include_path,
    )
