"""What the CLIP-like families share: calibrated on images, scored by zero-shot classification."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .base import FamilyUsageError, ModelFamily

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import DatasetSpec, EvaluationSpec, KeyChecker

__all__ = ["ZeroShotImageFamily", "image_calibration_rows"]


def image_calibration_rows(task: str, ds: Any, spec: DatasetSpec) -> Any:
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


class ZeroShotImageFamily(ModelFamily):
    """CLIP-like families: calibrated on images, scored by zero-shot classification."""

    is_image = True
    score_label = "zero-shot top-1 accuracy"
    calibration_data_keys = ("image_column",)
    evaluation_data_keys = ("dataset", "config", "split", "image_column", "label_column")
    evaluation_keys: ClassVar[tuple[str, ...]] = ("class_names", "templates")
    default_evaluation_batch_size = 64

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        return processing["image"]

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:
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

    def finish_evaluation_spec(self, v: KeyChecker, spec: DatasetSpec, entry: Mapping[str, Any], path: str) -> None:
        spec.label_column = v.string(entry.get("label_column"), f"{path}.label_column", optional=True)

    def check_evaluation(self, v, tasks, class_names, templates) -> None:
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
        return image_calibration_rows(task, ds, spec)

    def evaluation_source(self, task, data, configs, class_names):
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

    def evaluate_task(self, model, task, ds, data_spec, spec, *, processing, clip_model=None, device=None):
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
