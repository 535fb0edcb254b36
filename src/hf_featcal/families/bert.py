"""BERT and RoBERTa encoders: the ``bert`` family, calibrated on text (no built-in evaluation: their
heads are task-specific and are not merged)."""

from __future__ import annotations

from typing import Any

from ..architectures import model_type_of
from .base import FamilyUsageError, register_family
from .text import TextFamily

__all__ = ["BertFamily"]


@register_family
class BertFamily(TextFamily):
    """BERT / RoBERTa encoders (``*Model`` or a task model's backbone; the layer map's model types)."""

    name = "bert"
    article_name = "a BERT / RoBERTa"
    score_label = "no built-in evaluation"
    score_in_percent = False
    calibration_data_keys = ("text_column", "max_length")  # encoders carry no chat template
    evaluates = False
    no_evaluation_reason = ("their classification heads are task-specific and are not merged: score each task "
                            "with its own head on the calibrated encoder")

    def matches(self, model_or_config: Any) -> bool:
        from ..architectures.bert import BertLayerMap

        return model_type_of(model_or_config) in BertLayerMap.model_types

    def default_evaluation_split(self, task: str) -> str:
        return "test"

    def evaluation_source(self, task, data, configs, class_names):
        raise FamilyUsageError(f"hf-featcal evaluate has no evaluation for BERT / RoBERTa: {self.no_evaluation_reason}")
