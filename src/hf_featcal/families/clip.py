"""transformers CLIP models (``CLIPModel``, ``CLIPVisionModel``): the ``clip`` family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..architectures import model_type_of
from .base import FamilyUsageError, register_family
from .image import ZeroShotImageFamily

__all__ = ["CLIPFamily"]


@register_family
class CLIPFamily(ZeroShotImageFamily):
    """transformers CLIP: a ``CLIPModel`` or a bare ``CLIPVisionModel`` (text tower from the base)."""

    name = "clip"
    article_name = "a CLIP"
    processing_name = "CLIPImageProcessor"
    evaluation_keys = ("class_names", "templates", "clip_model")

    def matches(self, model_or_config: Any) -> bool:
        return model_type_of(model_or_config) in ("clip", "clip_vision_model")

    def load_processing(self, source: str) -> dict[str, Any]:
        """The image processor (``"image"``) and, when `source` also has a tokenizer, a ``CLIPProcessor``
        of the two (``"processor"``; else None). Raises when `source` has no image processor."""
        from transformers import CLIPImageProcessor

        parts = {"image": CLIPImageProcessor.from_pretrained(source, trust_remote_code=False),
                 "tokenizer": self._tokenizer(source)}
        return self.assemble_processing(parts)

    @staticmethod
    def _tokenizer(source: str) -> Any:
        from ..processing import tokenizer_of

        return tokenizer_of(source)

    def load_processing_parts(self, source: str) -> dict[str, Any]:
        """The image processor and the tokenizer `source` has (an expert's folder often has only the
        image processor; its base has both)."""
        from transformers import CLIPImageProcessor

        try:
            image = CLIPImageProcessor.from_pretrained(source, trust_remote_code=False)
        except (OSError, ValueError, TypeError):
            image = None
        return {"image": image, "tokenizer": self._tokenizer(source)}

    def assemble_processing(self, parts: Mapping[str, Any]) -> dict[str, Any]:
        """``"image"``, ``"tokenizer"`` and, when both are there, their ``CLIPProcessor`` (``"processor"``)."""
        from transformers import CLIPProcessor

        image, tokenizer = parts.get("image"), parts.get("tokenizer")
        processor = None if image is None or tokenizer is None else CLIPProcessor(image_processor=image,
                                                                                  tokenizer=tokenizer)
        return {"image": image, "tokenizer": tokenizer, "processor": processor}

    def processing_to_save(self, processing: Mapping[str, Any] | None) -> list[Any]:
        """The CLIPProcessor (tokenizer and image processor) when both were found, else what was."""
        if processing is not None and processing.get("processor") is not None:
            return [processing["processor"]]
        return super().processing_to_save(processing)

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        if processing.get("image") is None:
            raise ValueError("CLIP calibration needs the image processor (preprocessor_config.json) of the model, "
                             "the base or --processor; none was found")
        return processing["image"]

    def command_text_model(self, model, clip_source, load):
        if clip_source is not None:
            return load(clip_source, "--clip-model")
        if not hasattr(model, "get_text_features"):
            raise FamilyUsageError(
                f"--model is a {type(model).__name__} (no text tower): pass --clip-model, the base CLIPModel")
        return None

    def recipe_text_model(self, base, evaluation, processing, load):
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
                "CLIP zero-shot evaluation needs a tokenizer with the image processor (a CLIPProcessor); pass "
                "--processor")
