"""open_clip models (a ``CLIP`` or its ``VisionTransformer``): the ``open_clip`` family."""

from __future__ import annotations

from typing import Any

from .base import FamilyUsageError, register_family
from .image import ZeroShotImageFamily

__all__ = ["OpenCLIPFamily"]


@register_family
class OpenCLIPFamily(ZeroShotImageFamily):
    """open_clip models (a ``CLIP`` or its ``VisionTransformer``): their own text tower, preprocess
    transform and tokenizer, saved the open_clip way."""

    name = "open_clip"
    article_name = "an open_clip"
    processing_name = "open_clip config"
    source_schemes = {"hf-hub:": "hub", "local-dir:": "local"}  # architectures.openclip.HF_HUB / LOCAL_DIR

    def matches(self, model_or_config: Any) -> bool:
        # by where the class is defined (`architectures.openclip.is_open_clip_model`), without importing torch
        return type(model_or_config).__module__.startswith("open_clip.")

    def load_processing(self, source: str) -> dict[str, Any]:
        """The checkpoint's preprocess transform (``"image"``) and ``(tokenizer, preprocess)``."""
        from ..architectures.openclip import load_open_clip_processing

        tokenizer, preprocess = load_open_clip_processing(source)
        return {"image": preprocess, "processor": (tokenizer, preprocess)}

    def check_evaluate_options(self, *, class_names, templates, clip_model) -> None:
        if clip_model:
            raise FamilyUsageError(
                "--clip-model is only for transformers CLIP models (an open_clip model uses its own text tower)")

    def command_text_model(self, model, clip_source, load):
        if not hasattr(model, "encode_text"):
            raise FamilyUsageError(
                f"--model is an open_clip {type(model).__name__} without a text tower: evaluate the full CLIP")
        return None

    def recipe_text_model(self, base, evaluation, processing, load):
        if not hasattr(base, "encode_text"):
            raise ValueError(
                f"evaluation: zero-shot evaluation needs a text tower: the base is a {type(base).__name__}; "
                "use an open_clip CLIP as the base (or evaluation: false)"
            )
        return None, processing
