"""No post-merging step: the merge as it is (the grid's "<merge>" row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..registry import PostMergingResult, PostMergingStep, register_step


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any = None, *, config: Any = None,
          processing_class: Any = None, device: Any = None) -> PostMergingResult:
    """`merged` itself, unchanged (no copy)."""
    return PostMergingResult(merged)


STEP = register_step(PostMergingStep(
    "none", apply, summary="the merged model as it is", reference="—",
))
