"""ViT image encoders: the ``vit`` family, calibrated on images processed by the base's image processor
(no built-in evaluation: their classification heads are task-specific and are not merged)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..architectures import model_type_of
from .base import FamilyUsageError, ModelFamily, register_family
from .image import image_calibration_rows

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import DatasetSpec

__all__ = ["ViTFamily"]


@register_family
class ViTFamily(ModelFamily):
    """ViT (``ViTModel`` or a ``ViTForImageClassification`` backbone)."""

    name = "vit"
    article_name = "a ViT"
    processing_name = "image processor"
    score_label = "no built-in evaluation"
    score_in_percent = False
    calibration_data_keys = ("image_column",)
    evaluates = False
    no_evaluation_reason = ("its classification heads are task-specific and are not merged: score each task with "
                            "its own head on the calibrated backbone")

    def matches(self, model_or_config: Any) -> bool:
        from ..architectures.vit import ViTLayerMap

        return model_type_of(model_or_config) in ViTLayerMap.model_types

    def load_processing(self, source: str) -> dict[str, Any]:
        from transformers import AutoImageProcessor

        return {"image": AutoImageProcessor.from_pretrained(source, trust_remote_code=False)}

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        return processing["image"]

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:
        spec.image_column = v.string(entry.get("image_column"), key("image_column"), optional=True)

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        return {"image_column": spec.image_column} if spec.image_column else {}

    def default_evaluation_split(self, task: str) -> str:
        return "test"

    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        return image_calibration_rows(task, ds, spec)

    def evaluation_source(self, task, data, configs, class_names):
        raise FamilyUsageError(f"hf-featcal evaluate has no evaluation for ViT: {self.no_evaluation_reason}")
