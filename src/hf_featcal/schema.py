"""The recipe schema, declared once: name, type, range or choices, default and help.

* The merge methods and their parameters are declared by each method's file in
  `hf_featcal.merging.methods` and read from the registry (`merge_parameters`): `hf_featcal.merging`
  checks its arguments with them, `hf_featcal.recipes` validates a recipe's ``merge`` section with
  them, and `hf_featcal.cli` generates the ``hf-featcal merge`` flags.
* `RECIPE_SECTIONS`: every other recipe key (the ``featcal`` section is `FeatCalConfig`'s fields).
  `hf_featcal.recipes` validates a recipe with them (the keys a section allows, the required ones,
  each scalar's type, range and default), `render_recipe_schema` writes the schema of the recipes
  module docstring, ``hf-featcal run --help`` and docs/recipes.md from them, and `hf_featcal.cli`
  generates the flags that set a recipe key (``calibrate --split``, ``--num-examples``,
  ``evaluate --max-samples``, ``--output-dir``, ...) with their type, check, help and default.

Plain frozen dataclasses rather than pydantic: the declarations are a few dozen scalars, the package
already uses dataclasses for `FeatCalConfig` (PEFT style, ``metadata={"help": ...}``), the recipe
validator must name key paths such as ``calibration.tasks.cola.max_input_length`` in its own words and
resolve model / dataset paths against the recipe's folder (a pydantic model would need a validator per
field for both), and this module must stay import-light (no torch, no pydantic) because
``hf-featcal --help`` reads it. The recipe's nested sections also hold task-keyed mappings
(``<task>`` in a path), which a path → declaration table says plainly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from .merging import MergeParameter, get_method, merge_methods
from .merging.params import show_value as _show
from .post_merging import recipe_step_names, step_names

__all__ = [
    "MergeParameter",
    "RECIPE_SECTIONS",
    "RecipeKey",
    "TASK",
    "declare_families",
    "families_note",
    "check_integer",
    "check_string",
    "merge_parameters",
    "recipe_key",
    "recipe_keys",
    "render_recipe_schema",
]


def merge_parameters(method: str) -> dict[str, MergeParameter]:
    """Name -> declaration of ``method``'s parameters (aliases resolved), from the merge-method registry;
    KeyError for an unknown method."""
    return get_method(method).declared()


def _merge_method_names() -> tuple[str, ...]:
    """The methods a recipe's ``merge`` section takes (those that need no calibration data)."""
    return tuple(merge_methods(calibration_data=False))


# ======================================================================== the recipe sections
def check_integer(value: object, minimum: int | None = None, optional: bool = False) -> int | None:
    """``value`` if it is an integer (≥ `minimum`; None when `optional`); ValueError (without the name)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or (minimum is not None and value < minimum):
        bound = f" ≥ {minimum}" if minimum is not None else ""
        extra = " or null" if optional else ""
        raise ValueError(f"must be an integer{bound}{extra}, got {_show(value)}")
    return int(value)


def check_string(value: object, optional: bool = False) -> str | None:
    """``value`` if it is a non-empty string (None when `optional`); ValueError (without the name)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string{' or null' if optional else ''}, got {_show(value)}")
    return value


#: Hub repo ids (``name`` or ``owner/name``).
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")

#: Stands for any expert task name in a key path (``calibration.tasks.<task>.split``).
TASK = "<task>"

#: What a value of each kind looks like, in the rendered schema.
_KIND_TEXT = {
    "model": "<hub id or local model folder>",
    "dataset": "<hub id or local dataset folder>",
    "str": "<string>",
    "int": "<int>",
    "folder": "<folder>",
    "repo_id": "<hub repo id owner/name>",
    "section": "",
    "mapping": "",
    "list": "[<name>, ...]",
    "bool": "true | false",
    # a choice whose names a registry fills (model families) before they are registered: the schema alone
    # does not know them
    "choice": "<a registered name>",
}


@dataclass(frozen=True)
class RecipeKey:
    """One key of a recipe section.

    ``kind`` is one of ``choice`` (one of ``choices``), ``int`` (≥ ``minimum``), ``str``, ``model`` /
    ``dataset`` (a hub id or a local path, resolved against the recipe's folder), ``folder``,
    ``repo_id``, ``bool``, ``list`` (of strings), ``section`` (a mapping declared in `RECIPE_SECTIONS`) or
    ``mapping`` (task → value). ``nullable``: null is accepted (and means the default's meaning).
    ``default_text`` spells a default that depends on other keys. ``option``: the CLI flag that sets
    this key, where the commands spell it differently from ``--<name>``.
    """

    name: str
    kind: str
    help: str
    default: Any = None
    default_text: str | None = None
    required: bool = False
    minimum: int | None = None
    nullable: bool = False
    choices: tuple[str, ...] = ()
    value_text: str | None = None
    option: str | None = None
    metavar: str | None = None
    choices_of: Callable[[], tuple[str, ...]] | None = None

    @property
    def flag(self) -> str:
        """The command-line flag that sets this key."""
        return self.option or "--" + self.name.replace("_", "-")

    def allowed(self) -> tuple[str, ...]:
        """The choices, read when asked from ``choices_of`` where given (a registry that may grow)."""
        return self.choices_of() if self.choices_of is not None else self.choices

    def describe_value(self) -> str:
        """E.g. ``clip | flan_t5 | open_clip``, ``<int ≥ 1 or null>``."""
        if self.value_text is not None:
            return self.value_text
        if self.kind == "list" and self.allowed():
            return "[" + " | ".join(self.allowed()) + ", ...]"
        if self.allowed():
            return " | ".join(self.allowed())
        if self.kind == "int":
            bound = f" ≥ {self.minimum}" if self.minimum is not None else ""
            return f"<int{bound}{' or null' if self.nullable else ''}>"
        text = _KIND_TEXT[self.kind]
        return f"{text[:-1]} or null>" if self.nullable and text.endswith(">") else text

    def describe_default(self) -> str | None:
        """The default as the schema shows it (None for a required key or a key without one)."""
        if self.required:
            return None
        if self.default_text is not None:
            sizes = ", ".join(f"{f.name} {f.default_evaluation_batch_size}" for f in _FAMILIES)
            return self.default_text.replace("{batch_sizes}", sizes)
        if self.default is None:
            return "null" if self.nullable else None
        return _yaml_text(self.default)

    def check(self, value: object, optional: bool | None = None) -> Any:
        """A scalar value checked against the declaration (kinds ``choice``, ``int``, ``str``,
        ``folder``, ``repo_id``); ValueError with the problem (without the key path) otherwise."""
        nullable = self.nullable if optional is None else optional
        if self.kind == "int":
            return check_integer(value, self.minimum, nullable)
        if self.kind == "str":
            return check_string(value, nullable)
        if self.kind == "choice":
            if value not in self.allowed():
                raise ValueError(f"must be one of {list(self.allowed())}, got {value!r}")
            return value
        if self.kind == "folder":
            if not isinstance(value, str) or not value:
                raise ValueError(f"must be a string (a folder), got {value!r}")
            return value
        if self.kind == "bool":
            if value is None and nullable:
                return None
            if not isinstance(value, bool):
                raise ValueError(f"must be true or false{', or null' if nullable else ''}, got {value!r}")
            return value
        if self.kind == "repo_id":
            if value is None and nullable:
                return None
            if not isinstance(value, str) or "/" not in value or not HUB_ID.match(value):
                raise ValueError(
                    f"must be a hub repo id such as 'me/my-model'{', or null' if nullable else ''}; got {value!r}"
                )
            return value
        raise TypeError(f"RecipeKey.check does not check {self.kind!r} values ({self.name})")


_CALIBRATION_DATA = (
    RecipeKey("dataset", "dataset",
              "calibration dataset; '{task}' is replaced by the task name (also in config and split)",
              option="--data-default", metavar="DATASET"),
    RecipeKey("config", "str", "dataset config name (hub datasets)", nullable=True, option="--data-default-config",
              metavar="NAME"),
    RecipeKey("split", "str", "calibration split (a local DatasetDict: its key; a local Dataset is used whole)",
              default="train"),
    RecipeKey("num_examples", "int", "calibration examples per task (shuffled with featcal.seed, then cut; null: all)",
              default=256, minimum=1, nullable=True, default_text="featcal.num_samples_per_task if given, else 256"),
    RecipeKey("image_column", "str", "the image column (renamed to image)", nullable=True, default_text="image / img"),
    RecipeKey("glue_task", "str", "the GLUE task whose prompt format is applied", default_text="the task name"),
    RecipeKey("max_input_length", "int", "prompt truncation length in tokens (null: none)", default=512, minimum=1,
              nullable=True),
    RecipeKey("max_target_length", "int", "target truncation length in tokens (null: none)", default=32, minimum=1,
              nullable=True),
    RecipeKey("text_column", "str", "the text column, tokenised by the base's tokenizer", nullable=True,
              default_text="text"),
    RecipeKey("messages_column", "str", "instead of text_column: a column of chat messages ([{role, content}, "
              "...]) rendered by the base's chat template", nullable=True),
    RecipeKey("max_length", "int", "token truncation length of each text (null: none)", default=512, minimum=1,
              nullable=True),
)

#: Section path -> its keys, in the order the schema shows them. ``""`` is the top level; ``<task>``
#: stands for an expert's task name; ``merge`` holds ``method`` and the method's parameters
#: (`merge_parameters`), ``featcal`` the fields of `FeatCalConfig`.
RECIPE_SECTIONS: dict[str, tuple[RecipeKey, ...]] = {
    "": (
        # choices: the registered families (`declare_families`)
        RecipeKey("model_family", "choice", "the kind of model", required=True, choices=()),
        RecipeKey("base", "model", "the pre-trained model the experts were fine-tuned from (open_clip: "
                  "hf-hub:<repo> | local-dir:<folder> | <folder>)", required=True),
        RecipeKey("experts", "mapping", "task -> the fine-tuned expert (hub id or local folder)", required=True),
        RecipeKey("merge", "section", "how the experts are merged: a method and its parameters", required=True),
        RecipeKey("featcal", "section", "any FeatCalConfig field", default_text="FeatCalConfig defaults"),
        RecipeKey("calibration", "section", "where each task's calibration examples come from", required=True),
        # choices: the registered steps that are not FeatCal variants (`recipe_step_names`), read when asked
        RecipeKey("post_merging", "choice", "the post-merging step run on the merge: featcal as the featcal section "
                  "sets it (its variants are that section's fields), or another registered step, saved with its "
                  "per-task modules where it has them; {<step>: {<param>: <value>}} sets the step's parameters",
                  default="featcal", choices_of=recipe_step_names),
        RecipeKey("evaluation", "section", "what is scored before and after calibration (false: nothing)",
                  value_text="false | {...}",
                  default_text="enabled with defaults; bert / vit: false, they have none"),
        RecipeKey("output_dir", "folder", "where the calibrated model is saved (relative to the working directory)",
                  default_text="outputs/<recipe file stem>"),
        RecipeKey("push_to_hub", "repo_id", "also upload the files of this save (not the rest of the output folder) "
                  "to this hub repo", nullable=True, metavar="REPO_ID"),
        RecipeKey("private", "bool", "create the push_to_hub repo private (null: the hub's default)", nullable=True),
        RecipeKey("overwrite", "bool", "save into a non-empty output_dir that is not an earlier hf_featcal save: "
                  "this save's files replace same-named ones, other files are kept", default=False),
        RecipeKey("compare", "section", "the grid of hf-featcal compare RECIPE (ignored by run)"),
    ),
    "experts": (RecipeKey(TASK, "model", "the expert of this task"),),
    "merge": (RecipeKey("method", "choice", "the merge method", required=True, choices_of=_merge_method_names),),
    "calibration": (
        RecipeKey("default", "section", "applies to every task"),
        RecipeKey("tasks", "mapping",
                  "per-task entries override default; <task>: <dataset> is short for {dataset: ...}"),
    ),
    "calibration.default": _CALIBRATION_DATA,
    f"calibration.tasks.{TASK}": _CALIBRATION_DATA,
    "evaluation": (
        RecipeKey("tasks", "list", "the evaluated tasks", value_text="[<task>, ...]", default_text="every expert"),
        RecipeKey("split", "str", "evaluation split", value_text="<split> | {<task>: <split>}",
                  default_text="clip / open_clip / causal_lm: test; flan_t5: validation (mnli: "
                  "validation_matched)"),
        RecipeKey("max_samples", "int",
                  "evaluate a seeded random subset (seed 0) of at most this many examples per task",
                  minimum=1, nullable=True),
        RecipeKey("batch_size", "int", "evaluation batch size", minimum=1, default_text="the family's: {batch_sizes}"),
        RecipeKey("datasets", "mapping", "per-task evaluation data: <task>: <dataset> or a mapping",
                  default_text="the calibration dataset and config"),
        RecipeKey("class_names", "mapping", "zero-shot class names in label order (required for non-built-in tasks)",
                  value_text="{<task>: [<name>, ...]}"),
        RecipeKey("templates", "mapping", "zero-shot prompt templates with the placeholder {c}",
                  value_text="{<task>: [\"a photo of a {c}.\", ...]}"),
        RecipeKey("clip_model", "model", "the CLIPModel whose text tower builds the zero-shot heads",
                  default_text="base"),
        RecipeKey("lm_eval_tasks", "list", "lm-evaluation-harness tasks also scored before and after calibration "
                  "(needs lm-eval[hf])", value_text="[<lm-eval task>, ...]"),
        RecipeKey("lm_eval_include_path", "folder", "a folder of lm-evaluation-harness task YAMLs (its "
                  "--include_path)", nullable=True, value_text="<local folder or null>"),
    ),
    f"evaluation.datasets.{TASK}": (
        RecipeKey("dataset", "dataset", "evaluation dataset", required=True),
        RecipeKey("config", "str", "dataset config name (hub datasets)", nullable=True),
        RecipeKey("split", "str", "evaluation split", default_text="evaluation.split"),
        RecipeKey("image_column", "str", "the image column (renamed to image)", nullable=True,
                  default_text="image / img"),
        RecipeKey("label_column", "str", "the label column (renamed to label)", nullable=True, default_text="label"),
        RecipeKey("text_column", "str", "the text column", nullable=True,
                  default_text="the calibration's if it reads one, else text"),
        RecipeKey("messages_column", "str", "the chat-messages column", nullable=True,
                  default_text="the calibration's"),
    ),
    "compare": (
        RecipeKey("merges", "mapping", "method -> parameters laid over its defaults (null: the defaults)",
                  value_text="{<method>: {<param>: <value>} | null}", default_text="hf_featcal.compare.DEFAULT_MERGES"),
        # choices: the registered post-merging steps (`hf_featcal.post_merging`), read when asked
        RecipeKey("post_merging", "list", "the post-merging steps; or a mapping step -> parameters laid over its "
                  "paper defaults (null: the defaults)", default_text="every step this build offers",
                  choices_of=step_names),
        RecipeKey("samples", "list", "calibration examples per task: every post-merging step that needs data runs at "
                  "each (the sample-efficiency chart); null: once, at featcal.num_samples_per_task",
                  value_text="[<int ≥ 1>, ...]", nullable=True),
    ),
}


def recipe_keys(section: str) -> dict[str, RecipeKey]:
    """Name -> declaration of a section's keys (``calibration.tasks.cola`` finds ``calibration.tasks.<task>``);
    KeyError for a section that is not declared."""
    if section not in RECIPE_SECTIONS:
        parts = section.split(".")
        section = ".".join(parts[:-1] + [TASK])
    return {k.name: k for k in RECIPE_SECTIONS[section]}


def recipe_key(path: str) -> RecipeKey:
    """The declaration of a dotted key path such as ``calibration.tasks.cola.max_input_length``."""
    section, _, name = path.rpartition(".")
    return recipe_keys(section)[name]


#: Section -> the `ModelFamily` attribute listing which of its keys a family takes (keys no family
#: lists are taken by every family).
FAMILY_KEY_ATTRIBUTES = {
    "calibration.default": "calibration_data_keys",
    f"calibration.tasks.{TASK}": "calibration_data_keys",
    "evaluation": "evaluation_keys",
    f"evaluation.datasets.{TASK}": "evaluation_data_keys",
}


#: The registered model families, in name order, as the family registry (`hf_featcal.families`)
#: declares them: the schema sits below the families and never imports them.
_FAMILIES: list[Any] = []


def declare_families(families: Sequence[Any]) -> None:
    """Record the registered model families (each with a ``name``, the `FAMILY_KEY_ATTRIBUTES` and a
    ``default_evaluation_batch_size``): the choices of ``model_family``, the "clip / open_clip only:"
    notes and the evaluation batch-size default come from them."""
    _FAMILIES[:] = families
    RECIPE_SECTIONS[""] = tuple(
        dataclasses.replace(key, choices=tuple(f.name for f in families)) if key.name == "model_family" else key
        for key in RECIPE_SECTIONS[""]
    )


def families_note(section: str, name: str) -> str:
    """``"clip / open_clip only: "`` when only some model families take the key `name` of `section`."""
    attribute = FAMILY_KEY_ATTRIBUTES.get(section)
    if attribute is None:
        return ""
    families = _FAMILIES
    owners = [f.name for f in families if name in getattr(f, attribute)]
    if not owners or len(owners) == len(families):
        return ""
    return f"{' / '.join(owners)} only: "


_COMMENT_COLUMN = 52


def _yaml_text(value: object) -> str:
    """A default as YAML spells it (true, null, 0.3, train)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def render_recipe_schema(indent: int = 0, featcal_fields: bool = True) -> str:  # noqa: C901 - one branch per key kind
    """The recipe schema as text (one line per key: ``name?: <value> [default]  # help``), from
    `RECIPE_SECTIONS`, the merge methods' declarations and (with `featcal_fields`) the fields of
    `FeatCalConfig` with their defaults.

    ``?`` marks an optional key, brackets its default; ``<task>`` is an expert's task name."""
    from .config import FeatCalConfig  # a dataclass module: no torch

    lines: list[tuple[int, str, str]] = []

    def add(depth: int, key: RecipeKey, section: str = "") -> None:
        default = key.describe_default()
        left = f"{key.name}{'' if key.required or key.name == TASK else '?'}: {key.describe_value()}".rstrip()
        if default is not None and key.kind != "section":
            left += f" [{default}]"
        note = families_note(section, key.name) + key.help
        if key.kind == "section" and default is not None:
            note += f" [{default}]"
        lines.append((depth, left, note))

    for key in RECIPE_SECTIONS[""]:
        add(0, key)
        if key.name == "experts":
            add(1, RECIPE_SECTIONS["experts"][0])
        elif key.name == "merge":
            add(1, RECIPE_SECTIONS["merge"][0])
            users: dict[str, list[tuple[str, MergeParameter]]] = {}
            for method, declared in merge_methods(calibration_data=False).items():
                for parameter in declared.parameters:
                    users.setdefault(parameter.name, []).append((method, parameter))
            for pname, owners in users.items():
                parameter = owners[0][1]
                defaults = {repr(p.default) for _, p in owners}
                default = (_yaml_text(parameter.default) if len(defaults) == 1
                           else ", ".join(f"{m}: {_yaml_text(p.default)}" for m, p in owners))
                methods = ", ".join(m for m, _ in owners)
                lines.append((1, f"{pname}?: {parameter.describe_range()} [{default}]", f"{methods}: {parameter.help}"))
        elif key.name == "featcal" and featcal_fields:
            for field_ in dataclasses.fields(FeatCalConfig):
                field_default = (field_.default if field_.default_factory is dataclasses.MISSING
                                 else field_.default_factory())
                lines.append((1, f"{field_.name}?: [{_yaml_text(field_default)}]", ""))
        elif key.name == "calibration":
            default_key, tasks = RECIPE_SECTIONS["calibration"]
            add(1, default_key)
            for entry in RECIPE_SECTIONS["calibration.default"]:
                add(2, entry, "calibration.default")
            add(1, tasks)
            lines.append((2, f"{TASK}: <hub id or local dataset folder> | {{<any key of default>}}", ""))
        elif key.name == "evaluation":
            for entry in RECIPE_SECTIONS["evaluation"]:
                add(1, entry, "evaluation")
                if entry.name == "datasets":
                    lines.append((2, f"{TASK}: <hub id or local dataset folder> | {{...}}", ""))
                    for item in RECIPE_SECTIONS[f"evaluation.datasets.{TASK}"]:
                        add(3, item, f"evaluation.datasets.{TASK}")
        elif key.name == "compare":
            for entry in RECIPE_SECTIONS["compare"]:
                add(1, entry)
    pad = " " * indent
    out = []
    for depth, left, note in lines:
        text = "  " * depth + left
        if not note:
            out.append(pad + text)
        elif len(text) < _COMMENT_COLUMN:
            out.append(pad + f"{text:<{_COMMENT_COLUMN}}# {note}")
        else:  # a long key line: its comment goes on the next line, at the comment column
            out.extend([pad + text, pad + " " * _COMMENT_COLUMN + f"# {note}"])
    return "\n".join(out)
