"""Model families: what the CLI, recipes and evaluation know about a kind of model, one class each.

A layer map (`hf_featcal.architectures.base.LayerMap`) says *how FeatCal calibrates* an architecture;
a `ModelFamily` says how the end-to-end tools handle it: how a model is recognised, which processing
classes it is saved with, which recipe / CLI data keys it takes, how its calibration rows are prepared,
how it is evaluated and what the score is called. The CLI (``hf-featcal``), the recipes
(`hf_featcal.recipes`) and the zero-shot evaluation look a family up here and never branch on its name.

Adding a family is one subclass decorated with `register_family`. This module imports no heavy library
at import time (``hf-featcal --help`` reads the family names from it); each method imports what it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from . import model_type_of

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes import DatasetSpec, EvaluationSpec

__all__ = [
    "FamilyUsageError",
    "ModelFamily",
    "detect_family",
    "family_names",
    "get_family",
    "image_family_names",
    "iter_families",
    "register_family",
]


class FamilyUsageError(ValueError):
    """Options that do not fit the model family (the CLI prints it as a usage error, exit status 2)."""


class ModelFamily:
    """Everything the CLI, recipes and evaluation need to know about one family of models.

    Class attributes (data) describe the recipe / CLI schema of the family; the methods do the work
    that differs between families. Subclasses register themselves with `register_family`.
    """

    #: The ``model_family`` value of recipes and ``--family`` of the CLI.
    name: ClassVar[str]
    #: How error messages name a model of the family ("a CLIP").
    article_name: ClassVar[str]
    #: What `load_processing` looks for (named when none is found).
    processing_name: ClassVar[str] = "tokenizer"
    #: The headline score printed above evaluation tables.
    score_label: ClassVar[str]
    #: A longer form of `score_label` for `hf-featcal evaluate` (default: the same).
    score_description: ClassVar[str | None] = None
    #: Calibration images (zero-shot evaluation) rather than text.
    is_image: ClassVar[bool] = False
    #: Per-dataset keys the family adds to ``dataset``, ``config``, ``split``, ``num_examples``.
    calibration_data_keys: ClassVar[tuple[str, ...]] = ()
    #: Keys of one ``evaluation.datasets.<task>`` entry.
    evaluation_data_keys: ClassVar[tuple[str, ...]] = ("dataset", "config", "split")
    #: Which of the zero-shot keys (``class_names``, ``templates``, ``clip_model``) the family takes.
    evaluation_keys: ClassVar[tuple[str, ...]] = ()
    #: Default ``evaluation.batch_size`` / ``--batch-size`` of ``hf-featcal evaluate``.
    default_evaluation_batch_size: ClassVar[int] = 32
    #: Whether a dataset entry may leave ``split`` out (null).
    split_optional: ClassVar[bool] = False

    # --------------------------------------------------------------------------------- models
    def matches(self, model_or_config: Any) -> bool:
        """Whether a model (or its config) belongs to this family."""
        raise NotImplementedError

    @property
    def evaluation_label(self) -> str:
        """The score label of ``hf-featcal evaluate``."""
        return self.score_description or self.score_label

    # ----------------------------------------------------------------------------- processing
    def load_processing(self, source: str) -> dict[str, Any]:
        """The processing classes saved with `source` (hub id, folder), as a dict."""
        raise NotImplementedError

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        """What the calibrator applies to raw calibration rows."""
        raise NotImplementedError

    def processing_to_save(self, processing: Mapping[str, Any] | None) -> list[Any]:
        """What of `processing` is saved next to the model (`hf_featcal.saving`)."""
        from ..saving import processing_to_save

        return processing_to_save(processing)

    def processing_recorded_with_model(self, processing_class: Any, output_dir: str, model: Any) -> bool:
        """Whether `processing_class`, which has no ``save_pretrained``, is already recorded by the model
        files this family wrote into `output_dir` (`model` None: any model of the family)."""
        return False

    def pipeline_tag(self, model: Any) -> str | None:
        """The hub pipeline tag of `model` when the family decides it (None: from transformers' mapping)."""
        return None

    # ----------------------------------------------------------------------------- recipe data
    def complete_dataset_spec(
        self,
        v: Any,
        task: str,
        spec: DatasetSpec,
        entry: Mapping[str, Any],
        key: Callable[[str], str],
        substitute: Callable[[Any], Any],
        keys: Mapping[str, str],
        fallback: str,
    ) -> None:
        """Fill the family's fields of `spec` from a recipe entry (errors name ``key(field)``)."""

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        """The family's fields of a dataset spec, as a resolved recipe writes them."""
        return {}

    def default_evaluation_split(self, task: str) -> str:
        """The evaluation split of `task` (for text families, its GLUE task) when none is given."""
        raise NotImplementedError

    def inherit_from_calibration(self, entry: dict[str, Any], calibration: DatasetSpec) -> None:
        """Fields an evaluation entry takes over from the task's calibration spec."""

    def finish_evaluation_spec(self, v: Any, spec: DatasetSpec, entry: Mapping[str, Any], path: str) -> None:
        """Fields only evaluation datasets have."""

    def check_evaluation(
        self, v: Any, tasks: Sequence[str], class_names: Mapping[str, list[str]], templates: Mapping[str, list[str]]
    ) -> None:
        """Family checks of a recipe's ``evaluation`` section."""

    def evaluation_to_dict(self, evaluation: EvaluationSpec) -> dict[str, Any]:
        """The family's keys of a resolved recipe's ``evaluation`` section."""
        return {}

    # ----------------------------------------------------------------------------- calibration
    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        """One task's calibration ``Dataset`` from its loaded, shuffled and cut rows."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ evaluation
    def check_evaluate_options(self, *, class_names: Mapping[str, Any], templates: Mapping[str, Any],
                               clip_model: str | None) -> None:
        """Refuse ``hf-featcal evaluate`` options the family does not take."""

    def evaluation_source(
        self,
        task: str,
        data: Mapping[str, str],
        configs: Mapping[str, str],
        class_names: Mapping[str, Any],
    ) -> tuple[str, str | None, str | None]:
        """(dataset, config, GLUE task or None) that ``hf-featcal evaluate --task TASK`` reads."""
        raise NotImplementedError

    def command_text_model(self, model: Any, clip_source: str | None, load: Callable[[str, str], Any]) -> Any:
        """``hf-featcal evaluate``: the model whose text tower builds zero-shot heads (None: the model's
        own, or no zero-shot evaluation)."""
        return None

    def recipe_text_model(
        self, base: Any, evaluation: EvaluationSpec, processing: dict[str, Any], load: Callable[[str, str], Any]
    ) -> tuple[Any, dict[str, Any]]:
        """A recipe's (text-tower model, processing) for evaluation (checked before merging)."""
        return None, processing

    def check_evaluation_processing(self, processing: Mapping[str, Any]) -> None:
        """``hf-featcal evaluate``: refuse processing classes evaluation cannot use."""

    def evaluate_task(
        self,
        model: Any,
        task: str,
        ds: Any,
        data_spec: DatasetSpec,
        spec: EvaluationSpec,
        *,
        processing: Mapping[str, Any],
        clip_model: Any = None,
        device: Any = None,
    ) -> tuple[float, dict[str, Any]]:
        """(headline score in [0, 1], details) of `model` on one task's loaded evaluation rows."""
        raise NotImplementedError

    # ------------------------------------------------------------------------ zero-shot models
    def has_text_tower(self, model: Any) -> bool:
        """Whether `model` can embed zero-shot prompts."""
        return False


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: register a `ModelFamily` under its ``name`` (one instance)."""
    if not getattr(cls, "name", None):
        raise ValueError(f"{cls.__name__} needs a `name`")
    _FAMILIES[cls.name] = cls()
    return cls


def family_names() -> tuple[str, ...]:
    """Names of the registered families, sorted."""
    return tuple(sorted(_FAMILIES))


def image_family_names() -> tuple[str, ...]:
    """Names of the families calibrated on images and evaluated by zero-shot classification."""
    return tuple(name for name in family_names() if _FAMILIES[name].is_image)


def iter_families() -> list[ModelFamily]:
    """The registered families, in `family_names` order."""
    return [_FAMILIES[name] for name in family_names()]


def get_family(name: str) -> ModelFamily:
    """The family registered as `name`; KeyError names the known ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {list(family_names())}") from None


def detect_family(model_or_config: Any) -> ModelFamily | None:
    """The family of a model (or config), None when no registered family claims it."""
    for family in iter_families():
        if family.matches(model_or_config):
            return family
    return None


# ============================================================================== image families
class _ZeroShotImageFamily(ModelFamily):
    """CLIP-like families: calibrated on images, scored by zero-shot classification."""

    is_image = True
    score_label = "zero-shot top-1 accuracy"
    calibration_data_keys = ("image_column",)
    evaluation_data_keys = ("dataset", "config", "split", "image_column", "label_column")
    evaluation_keys = ("class_names", "templates")
    default_evaluation_batch_size = 64

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        return processing["image"]

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:  # type: ignore[override]
        spec.image_column = v.string(entry.get("image_column"), key("image_column"), optional=True)

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if spec.image_column:
            out["image_column"] = spec.image_column
        if spec.label_column and not calibration:
            out["label_column"] = spec.label_column
        return out

    def default_evaluation_split(self, task: str) -> str:
        return "test"

    def finish_evaluation_spec(self, v: Any, spec: DatasetSpec, entry: Mapping[str, Any], path: str) -> None:
        spec.label_column = v.string(entry.get("label_column"), f"{path}.label_column", optional=True)

    def check_evaluation(self, v, tasks, class_names, templates) -> None:  # type: ignore[override]
        from ..evaluation.clip_templates import CLIP_CLASS_NAMES, CLIP_TASK_ALIASES

        for task in tasks:
            known = task in CLIP_CLASS_NAMES or task in CLIP_TASK_ALIASES
            if not known and task not in class_names:
                raise v.error(
                    f"evaluation.class_names.{task}",
                    f"required: {task!r} is not a built-in CLIP task {sorted(CLIP_CLASS_NAMES)}, so its "
                    "zero-shot class names (in label order) must be given",
                )
        for task, names in class_names.items():
            if len(names) < 2:
                raise v.error(f"evaluation.class_names.{task}", f"needs at least 2 class names, got {len(names)}")
        for task, values in templates.items():
            for i, template in enumerate(values):
                if "{c}" not in template:
                    raise v.error(
                        f"evaluation.templates.{task}[{i}]",
                        f"must contain the class-name placeholder '{{c}}', got {template!r}",
                    )

    def evaluation_to_dict(self, evaluation: EvaluationSpec) -> dict[str, Any]:
        out: dict[str, Any] = {"class_names": dict(evaluation.class_names), "templates": dict(evaluation.templates)}
        if evaluation.clip_model is not None:
            out["clip_model"] = evaluation.clip_model
        return out

    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        """One ``image`` column (processed per batch by the calibrator); ``pixel_values`` as they are."""
        if "pixel_values" in ds.column_names and spec.image_column is None:
            return ds.select_columns(["pixel_values"])
        from ..data import IMAGE_COLUMNS, images_from_column

        column = spec.image_column or next((c for c in IMAGE_COLUMNS if c in ds.column_names), None)
        if column is None or column not in ds.column_names:
            raise ValueError(
                f"calibration.tasks.{task}: the dataset has no image column "
                f"{spec.image_column or list(IMAGE_COLUMNS)!r} (columns: {ds.column_names}); set image_column"
            )
        ds = images_from_column(ds.select_columns([column]), column, f"calibration.tasks.{task}")
        return ds.rename_column(column, "image") if column != "image" else ds

    def evaluation_source(self, task, data, configs, class_names):  # type: ignore[override]
        from ..evaluation.clip_templates import CLIP_CLASS_NAMES, CLIP_DATASETS, CLIP_TASK_ALIASES

        name = task if task in CLIP_CLASS_NAMES else CLIP_TASK_ALIASES.get(task)
        if name is None and task not in class_names:
            raise FamilyUsageError(
                f"--task {task}: not a built-in CLIP task {list(CLIP_DATASETS)}; give --class-names {task}=A,B,...")
        if task in data:
            return data[task], configs.get(task), None
        if name is not None:
            dataset, config = CLIP_DATASETS[name]
            return dataset, configs.get(task, config), None
        raise FamilyUsageError(f"--task {task}: a custom task needs --data {task}=DATASET")

    @staticmethod
    def _evaluation_columns(ds: Any, spec: DatasetSpec, task: str) -> Any:
        """Rename an evaluation dataset's image / label columns to ``image`` / ``label``."""
        for given, wanted in ((spec.image_column, "image"), (spec.label_column, "label")):
            if given and given != wanted:
                if given not in ds.column_names:
                    raise ValueError(f"evaluation.datasets.{task}: no column {given!r} (columns: {ds.column_names})")
                if wanted in ds.column_names:
                    ds = ds.remove_columns([wanted])
                ds = ds.rename_column(given, wanted)
        return ds

    def evaluate_task(self, model, task, ds, data_spec, spec, *, processing, clip_model=None, device=None):  # type: ignore[override]
        from ..evaluation.clip_zeroshot import evaluate_clip_zeroshot

        processor = processing.get("processor")
        if processor is None:
            raise ValueError(
                "CLIP zero-shot evaluation needs a CLIPProcessor (tokenizer + image processor) saved "
                "with the base / clip_model; none was found"
            )
        ds = self._evaluation_columns(ds, data_spec, task)
        kwargs: dict[str, Any] = {}
        if task in spec.class_names:
            kwargs["class_names"] = {task: spec.class_names[task]}
        if task in spec.templates:
            kwargs["templates"] = {task: spec.templates[task]}
        result = evaluate_clip_zeroshot(
            model, clip_model, processor, [task], datasets={task: ds}, batch_size=spec.batch_size, device=device,
            split=data_spec.split, **kwargs,
        )
        return float(result[task]), result.to_dict()

    # -------------------------------------------------------------------- zero-shot model API
    def encode_prompts(self, clip_model: Any, tokenizer: Any, prompts: list[str], device: Any,
                       max_length: int | None) -> Any:
        """Unnormalised text embeddings ``[len(prompts), dim]`` of `clip_model`'s text tower."""
        raise NotImplementedError

    def image_embeddings(self, vision_model: Any, pixel_values: Any, clip_model: Any) -> Any:
        """Projected (unnormalised) image embeddings ``[batch, dim]``."""
        raise NotImplementedError

    def check_vision_model(self, vision_model: Any, clip_model: Any) -> None:
        """Refuse a vision model whose images cannot be embedded next to `clip_model`'s prompts."""


@register_family
class CLIPFamily(_ZeroShotImageFamily):
    """transformers CLIP: a ``CLIPModel`` or a bare ``CLIPVisionModel`` (text tower from the base)."""

    name = "clip"
    article_name = "a CLIP"
    processing_name = "CLIPImageProcessor"
    evaluation_keys = ("class_names", "templates", "clip_model")

    def matches(self, model_or_config: Any) -> bool:
        return model_type_of(model_or_config) in ("clip", "clip_vision_model")

    def load_processing(self, source: str) -> dict[str, Any]:
        """The image processor (``"image"``) and, when there is a tokenizer, a ``CLIPProcessor``."""
        from transformers import CLIPImageProcessor, CLIPProcessor

        out: dict[str, Any] = {"image": CLIPImageProcessor.from_pretrained(source, trust_remote_code=False)}
        try:
            out["processor"] = CLIPProcessor.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError, TypeError):
            out["processor"] = None
        return out

    def command_text_model(self, model, clip_source, load):  # type: ignore[override]
        if clip_source is not None:
            return load(clip_source, "--clip-model")
        if not hasattr(model, "get_text_features"):
            raise FamilyUsageError(
                f"--model is a {type(model).__name__} (no text tower): pass --clip-model, the base CLIPModel")
        return None

    def recipe_text_model(self, base, evaluation, processing, load):  # type: ignore[override]
        if evaluation.clip_model is not None:
            clip_model = load(evaluation.clip_model, "evaluation.clip_model")
            if processing.get("processor") is None:
                processing = {**processing, "processor": self.load_processing(evaluation.clip_model)["processor"]}
            return clip_model, processing
        if hasattr(base, "text_model"):
            return base, processing
        raise ValueError(
            "evaluation: zero-shot CLIP evaluation needs a text tower: the base is a "
            f"{type(base).__name__}; set evaluation.clip_model to a CLIPModel (or evaluation: false)"
        )

    def check_evaluation_processing(self, processing: Mapping[str, Any]) -> None:
        if processing.get("processor") is None:
            raise FamilyUsageError(
                "CLIP zero-shot evaluation needs a tokenizer with the image processor (a CLIPProcessor); pass --processor")

    def has_text_tower(self, model: Any) -> bool:
        return hasattr(model, "get_text_features")

    def encode_prompts(self, clip_model, tokenizer, prompts, device, max_length):  # type: ignore[override]
        from ..evaluation.clip_zeroshot import _features

        enc = tokenizer(prompts, padding=True, truncation=max_length is not None, max_length=max_length,
                        return_tensors="pt")
        inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        return _features(clip_model.get_text_features(**inputs), "text_embeds")

    def image_embeddings(self, vision_model, pixel_values, clip_model):  # type: ignore[override]
        from ..evaluation.clip_zeroshot import _transformers_image_embeddings

        return _transformers_image_embeddings(vision_model, pixel_values, clip_model)

    def check_vision_model(self, vision_model, clip_model) -> None:  # type: ignore[override]
        from ..evaluation.clip_zeroshot import _check_transformers_vision_compat

        _check_transformers_vision_compat(vision_model, clip_model)


@register_family
class OpenCLIPFamily(_ZeroShotImageFamily):
    """open_clip models (a ``CLIP`` or its ``VisionTransformer``): their own text tower, preprocess
    transform and tokenizer, saved the open_clip way."""

    name = "open_clip"
    article_name = "an open_clip"
    processing_name = "open_clip config"

    def matches(self, model_or_config: Any) -> bool:
        # by where the class is defined (`architectures.openclip.is_open_clip_model`), without importing torch
        return type(model_or_config).__module__.startswith("open_clip.")

    def load_processing(self, source: str) -> dict[str, Any]:
        """The checkpoint's preprocess transform (``"image"``) and ``(tokenizer, preprocess)``."""
        from .openclip import load_open_clip_processing

        tokenizer, preprocess = load_open_clip_processing(source)
        return {"image": preprocess, "processor": (tokenizer, preprocess)}

    def processing_recorded_with_model(self, processing_class: Any, output_dir: str, model: Any) -> bool:
        # a torchvision transform or an open_clip tokenizer: open_clip_config.json holds its settings
        import os

        from .openclip import CONFIG_NAME

        module = type(processing_class).__module__
        return (module.startswith(("open_clip.", "torchvision.")) and (model is None or self.matches(model))
                and os.path.isfile(os.path.join(output_dir, CONFIG_NAME)))

    def pipeline_tag(self, model: Any) -> str | None:
        return "zero-shot-image-classification" if hasattr(model, "encode_text") else "image-feature-extraction"

    def check_evaluate_options(self, *, class_names, templates, clip_model) -> None:  # type: ignore[override]
        if clip_model:
            raise FamilyUsageError(
                "--clip-model is only for transformers CLIP models (an open_clip model uses its own text tower)")

    def command_text_model(self, model, clip_source, load):  # type: ignore[override]
        if not hasattr(model, "encode_text"):
            raise FamilyUsageError(
                f"--model is an open_clip {type(model).__name__} without a text tower: evaluate the full CLIP")
        return None

    def recipe_text_model(self, base, evaluation, processing, load):  # type: ignore[override]
        if not hasattr(base, "encode_text"):
            raise ValueError(
                f"evaluation: zero-shot evaluation needs a text tower: the base is a {type(base).__name__}; "
                "use an open_clip CLIP as the base (or evaluation: false)"
            )
        return None, processing

    def has_text_tower(self, model: Any) -> bool:
        return hasattr(model, "encode_text")

    def encode_prompts(self, clip_model, tokenizer, prompts, device, max_length):  # type: ignore[override]
        # open_clip tokenizers return the padded token ids
        return clip_model.encode_text(tokenizer(prompts).to(device))

    def image_embeddings(self, vision_model, pixel_values, clip_model):  # type: ignore[override]
        # CLIP.encode_image, or a bare VisionTransformer's projected output
        if hasattr(vision_model, "encode_image"):
            return vision_model.encode_image(pixel_values)
        return vision_model(pixel_values)

    def check_vision_model(self, vision_model, clip_model) -> None:  # type: ignore[override]
        if getattr(getattr(vision_model, "visual", vision_model), "proj", None) is None:
            raise ValueError("vision_model is an open_clip tower without a projection (proj is None)")


# =============================================================================== text families
@register_family
class FlanT5Family(ModelFamily):
    """FLAN-T5 (``T5ForConditionalGeneration``): GLUE prompts in, label words out, scored on GLUE."""

    name = "flan_t5"
    article_name = "a T5"
    score_label = "GLUE headline score"
    score_description = "GLUE headline score (accuracy; Spearman for stsb)"
    calibration_data_keys = ("glue_task", "max_input_length", "max_target_length")
    split_optional = True

    def matches(self, model_or_config: Any) -> bool:
        return model_type_of(model_or_config) == "t5"

    def load_processing(self, source: str) -> dict[str, Any]:
        from transformers import AutoTokenizer

        return {"tokenizer": AutoTokenizer.from_pretrained(source, trust_remote_code=False)}

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        return processing["tokenizer"]

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:  # type: ignore[override]
        from ..evaluation.glue import GLUE_TASKS

        glue_task = substitute(entry.get("glue_task", task))
        if glue_task not in GLUE_TASKS:
            name = key("glue_task") if "glue_task" in keys else fallback
            raise v.error(
                name,
                f"FLAN-T5 recipes use the GLUE prompt formats: task {glue_task!r} is not a GLUE task "
                f"{list(GLUE_TASKS)} (set glue_task to one)",
            )
        spec.glue_task = glue_task
        spec.max_input_length = v.integer(entry.get("max_input_length", 512), key("max_input_length"), 1, optional=True)
        spec.max_target_length = v.integer(entry.get("max_target_length", 32), key("max_target_length"), 1, optional=True)

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        if not calibration:
            return {}
        return {"glue_task": spec.glue_task, "max_input_length": spec.max_input_length,
                "max_target_length": spec.max_target_length}

    def default_evaluation_split(self, task: str) -> str:
        from ..evaluation.glue import GLUE_DEFAULT_SPLITS

        return GLUE_DEFAULT_SPLITS[task]

    def inherit_from_calibration(self, entry: dict[str, Any], calibration: DatasetSpec) -> None:
        entry["glue_task"] = calibration.glue_task

    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        """The GLUE prompt format, tokenised (``input_ids``, ``attention_mask``, ``labels``)."""
        from ..evaluation.glue import preprocess_glue_dataset

        ds = preprocess_glue_dataset(
            spec.glue_task or task, ds, processing["tokenizer"],  # type: ignore[index]
            max_input_length=spec.max_input_length, max_target_length=spec.max_target_length,
        )
        return ds.select_columns(["input_ids", "attention_mask", "labels"])

    def check_evaluate_options(self, *, class_names, templates, clip_model) -> None:  # type: ignore[override]
        if class_names or templates or clip_model:
            raise FamilyUsageError("--class-names, --template and --clip-model are only for CLIP models")

    def evaluation_source(self, task, data, configs, class_names):  # type: ignore[override]
        from ..evaluation.glue import GLUE_TASKS

        if task not in GLUE_TASKS:
            raise FamilyUsageError(f"--task {task}: not a GLUE task {list(GLUE_TASKS)}")
        return data.get(task, "nyu-mll/glue"), configs.get(task, task), task

    def evaluate_task(self, model, task, ds, data_spec, spec, *, processing, clip_model=None, device=None):  # type: ignore[override]
        from ..evaluation.glue import evaluate_glue

        glue_task = data_spec.glue_task or task
        result = evaluate_glue(model, processing["tokenizer"], [glue_task], datasets={glue_task: ds},
                               batch_size=spec.batch_size, device=device, split=data_spec.split)
        return float(result[glue_task]), result.to_dict()
