"""FeatCal with ``granularity="module"``: each linear map is calibrated on its own inputs, every map of
a block from the same forward (FeatCalConfig.granularity); otherwise as the ``featcal`` step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..registry import PostMergingResult, PostMergingStep, register_step
from .featcal import REFERENCE, calibrate


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any, *, config: Any = None,
          processing_class: Any = None, device: Any = None) -> PostMergingResult:
    """FeatCal module by module (`config` with ``granularity="module"``)."""
    return calibrate(merged, base, experts, calibration_data, config, processing_class, device, granularity="module")


STEP = register_step(PostMergingStep(
    "featcal_module", apply, summary="FeatCal, module-granular (granularity: module)",
    reference=REFERENCE, featcal_fields=("granularity",), needs_calibration_data=True,
))
