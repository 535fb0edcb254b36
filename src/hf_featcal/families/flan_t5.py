"""FLAN-T5 (``T5ForConditionalGeneration``): the ``flan_t5`` family, scored on GLUE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..architectures import model_type_of
from .base import FamilyUsageError, ModelFamily, register_family

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import DatasetSpec

__all__ = ["FlanT5Family"]


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
        from ..processing import tokenizer_of

        tokenizer = tokenizer_of(source)  # None for a folder without tokenizer files (not an empty tokenizer)
        if tokenizer is None:
            raise OSError(f"{source!r} has no tokenizer files")
        return {"tokenizer": tokenizer}

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        return processing["tokenizer"]

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:
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
        spec.max_target_length = v.integer(entry.get("max_target_length", 32), key("max_target_length"), 1,
                                           optional=True)

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

    def check_evaluate_options(self, *, class_names, templates, clip_model) -> None:
        if class_names or templates or clip_model:
            raise FamilyUsageError("--class-names, --template and --clip-model are only for CLIP models")

    def evaluation_source(self, task, data, configs, class_names):
        from ..evaluation.glue import GLUE_TASKS

        if task not in GLUE_TASKS:
            raise FamilyUsageError(f"--task {task}: not a GLUE task {list(GLUE_TASKS)}")
        return data.get(task, "nyu-mll/glue"), configs.get(task, task), task

    def evaluate_task(self, model, task, ds, data_spec, spec, *, processing, clip_model=None, device=None):
        from ..evaluation.glue import evaluate_glue

        glue_task = data_spec.glue_task or task
        result = evaluate_glue(model, processing["tokenizer"], [glue_task], datasets={glue_task: ds},
                               batch_size=spec.batch_size, device=device, split=data_spec.split)
        return float(result[glue_task]), result.to_dict()
