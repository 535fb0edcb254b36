"""What a validated recipe is made of: its spec dataclasses, `RecipeError` (key and reason as fields)
and `KeyChecker`, the value checks the parsers, the model families and the CLI share.

This module imports neither the families nor the run stages: the families type against it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..schema import (
    HUB_ID,
    RecipeKey,
    check_integer,
    check_string,
    recipe_key,
    recipe_keys,
)

__all__ = [
    "CompareSpec",
    "DatasetSpec",
    "EvaluationSpec",
    "KeyChecker",
    "MergeSpec",
    "RecipeError",
]

_CALIBRATION_DATA = recipe_keys("calibration.default")
DEFAULT_NUM_EXAMPLES: int = _CALIBRATION_DATA["num_examples"].default


class RecipeError(ValueError):
    """An invalid recipe (or CLI value): ``key`` is the offending key path (e.g. ``"merge.density"``;
    "" for the recipe as a whole), ``reason`` what is wrong with it, ``source`` the recipe file (if any).
    The message is ``"<source>: <key>: <reason>"``."""

    def __init__(self, key: str, reason: str, source: str | None = None) -> None:
        self.key = key
        self.reason = reason
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {reason}" if key else f"{where}{reason}")


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
        text_column, messages_column: text families: the column of text, or of chat messages rendered
            by the base's chat template (None: ``text``).
        max_length: text families: token truncation length (None: none).
    """

    dataset: str
    config: str | None = None
    split: str = _CALIBRATION_DATA["split"].default
    num_examples: int | None = DEFAULT_NUM_EXAMPLES
    is_local: bool = False
    image_column: str | None = None
    label_column: str | None = None
    glue_task: str | None = None
    max_input_length: int | None = _CALIBRATION_DATA["max_input_length"].default
    max_target_length: int | None = _CALIBRATION_DATA["max_target_length"].default
    text_column: str | None = None
    messages_column: str | None = None
    max_length: int | None = _CALIBRATION_DATA["max_length"].default


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
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_include_path: str | None = None


@dataclass
class CompareSpec:
    """The grid of `hf-featcal compare RECIPE`: method → parameters; the post-merging steps (None: every
    registered step, `hf_featcal.post_merging.step_names`) with the parameters laid over each one's
    paper defaults; and the numbers of calibration examples per task the steps run at (None: once)."""

    merges: dict[str, dict[str, Any]]
    post_merging: list[str] | None = None
    step_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: list[int] | None = None


class KeyChecker:
    """Checks of recipe values that raise `RecipeError`s naming the key path: what the recipe parsers,
    the model families (`hf_featcal.families`) and the CLI check values with.

    `source`: the recipe file named in errors; `base_dir`: where relative local paths are looked up
    first; `schemes`: model-source reference schemes to keep, each to ``"hub"`` or ``"local"``
    (`hf_featcal.families.source_schemes`: open_clip's ``hf-hub:`` / ``local-dir:``)."""

    def __init__(self, source: str | None = None, base_dir: str | None = None,
                 schemes: Mapping[str, str] | None = None) -> None:
        self.source_name = source
        self.base_dir = base_dir if base_dir is not None else os.getcwd()
        self.schemes = dict(schemes or {})

    def error(self, key: str, reason: str) -> RecipeError:
        """A `RecipeError` of `key` in this checker's recipe."""
        return RecipeError(key, reason, self.source_name)

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
            raise self.error(path, f"must be a mapping, got {show(section)}")
        for key in section:
            if key not in allowed:
                raise self.error(join_key(path, str(key)), f"unknown key; valid keys here: {list(allowed)}")
        for key in required:
            if key not in section or section[key] is None:
                raise self.error(join_key(path, key), "is required")

    def task_name(self, task: Any, path: str) -> None:
        if not isinstance(task, str) or not task.strip():
            raise self.error(f"{path}.{task}", f"task names must be non-empty strings, got {task!r}")

    def source(self, value: Any, path: str, kind: str) -> str:
        """A hub id or an existing local path (returned absolute); a reference with one of `schemes`
        (open_clip's `hf-hub:<hub id>`, `local-dir:<path>`) keeps its scheme."""
        schemes = self.schemes
        scheme = next((s for s in schemes if isinstance(value, str) and value.startswith(s)), None)
        if scheme is not None:
            rest = value[len(scheme):]
            if schemes[scheme] == "local":
                local = self.local_path(rest, path, kind)
                if local is None:
                    raise self.error(path, f"local {kind} path {rest!r} does not exist")
                return f"{scheme}{local}"
            if not HUB_ID.match(rest) or ".." in rest:
                raise self.error(path, f"{rest!r} is not a valid hub id")
            return value
        local = self.local_path(value, path, kind)
        return local if local is not None else value

    def local_path(self, value: Any, path: str, kind: str) -> str | None:
        """The absolute local path `value` names, or None when it is a hub id."""
        if not isinstance(value, str) or not value.strip():
            raise self.error(path, f"must be a string (a hub id or a local {kind} path), got {show(value)}")
        expanded = os.path.expanduser(value)
        explicit_local = os.path.isabs(expanded) or value.startswith(("./", "../", "~", ".\\", "..\\"))
        candidates = [expanded] if os.path.isabs(expanded) else [os.path.join(self.base_dir, expanded), expanded]
        for candidate in candidates:
            if os.path.exists(candidate):
                return os.path.abspath(candidate)
        if explicit_local:
            raise self.error(path, f"local {kind} path {value!r} does not exist")
        if looks_local(value, [self.base_dir, os.getcwd()]):
            raise self.error(path, f"no local folder {value!r} ({PATH_RULE})")
        if not HUB_ID.match(value) or ".." in value:
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
            raise self.error(path, f"must be a non-empty list of strings, got {show(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise self.error(f"{path}[{i}]", f"must be a non-empty string, got {show(item)}")
        return list(value)


#: How a source that names nothing local is told from a hub id (said in the error; docs/recipes.md).
PATH_RULE = ("a source is a local path when it starts with '/', './', '../' or '~', has a backslash or more "
             "than one '/', or when its first part before '/' is an existing local folder; "
             "otherwise `org/name` is a hub id")


def looks_local(value: str, folders: list[str]) -> bool:
    """Whether `value`, which names no existing path, is still meant as a local path (`PATH_RULE`): more
    than one ``/``, a backslash, or an ``org/name`` form whose ``org`` is an existing folder in one of
    `folders` (``tiny/bse`` beside ``tiny/base``): refused at once instead of asking the hub for it."""
    if "\\" in value or value.count("/") > 1:
        return True
    if "/" not in value:
        return False
    first = value.split("/", 1)[0]
    return any(os.path.isdir(os.path.join(folder, first)) for folder in folders)


def join_key(path: str, key: str) -> str:
    """``path.key`` (``key`` at the top level)."""
    return f"{path}.{key}" if path else key


def show(value: Any) -> str:
    """A value and its type, as errors quote it."""
    return f"{value!r} ({type(value).__name__})"
