"""FeatCal (arXiv 2605.13030): block by block, each linear map of the merged model is recalibrated in
closed form so that its output on the merged model's own features matches the experts' (the method:
docs/featcal-method.md). Its settings are `FeatCalConfig`'s fields (a recipe's ``featcal`` section),
the grid's ``config``; the result is one model of the merged model's architecture and size."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..registry import PostMergingResult, PostMergingStep, register_step

REFERENCE = "FeatCal, arXiv 2605.13030 (this library)"


def calibrate(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any, config: Any,
              processing_class: Any, device: Any, **changes: Any) -> PostMergingResult:
    """FeatCal on a copy of `merged` with `config` (default: the paper's `FeatCalConfig`) and `changes`
    to it laid over; the copy, calibrated, with its drift report."""
    from ...calibrator import FeatCalCalibrator
    from ...config import FeatCalConfig

    settings = dataclasses.replace(config if config is not None else FeatCalConfig(), **changes)
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, dict(experts), calibration_data, settings,
                                   processing_class=processing_class, device=device, show_progress=False)
    return PostMergingResult(calibrator.calibrate(), report=calibrator.report)


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any, *, config: Any = None,
          processing_class: Any = None, device: Any = None) -> PostMergingResult:
    """FeatCal at the granularity `config` sets (the paper's: block by block)."""
    return calibrate(merged, base, experts, calibration_data, config, processing_class, device)


STEP = register_step(PostMergingStep(
    "featcal", apply, summary="closed-form feature calibration, block by block (FeatCalConfig's settings)",
    reference=REFERENCE, featcal_fields=(), needs_calibration_data=True,
))
