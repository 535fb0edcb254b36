"""Singular Value Calibration (SVC), data-free: `hf_featcal.merging.svc.singular_value_calibration`
(the formulas are in its docstring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...merging.params import MERGE_CONFIG_ATTRIBUTE
from ...merging.svc import SVC_ALPHA, SVC_REFERENCE, svc_alpha_for
from ..registry import PostMergingResult, PostMergingStep, register_step


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any = None, *, config: Any = None,
          processing_class: Any = None, device: Any = None, alpha: float | None = None) -> PostMergingResult:
    """SVC with floor `alpha` (None: FusionBench's α after the merge `merged` records,
    `svc_alpha_for`); a new model."""
    from ...merging import singular_value_calibration

    if alpha is None:
        record = getattr(getattr(merged, "config", None), MERGE_CONFIG_ATTRIBUTE, None)
        alpha = svc_alpha_for(record.get("method") if isinstance(record, Mapping) else None)
    return PostMergingResult(singular_value_calibration(merged, base, experts, alpha=alpha, device=device))


STEP = register_step(PostMergingStep(
    "svc", apply, summary="rescale each merged matrix's singular values by how many tasks share the direction",
    reference=SVC_REFERENCE.split("; FusionBench")[0],
    fusionbench="fusion_bench.method.singular_value_calibration.SingularValueCalibration",
    # default None: the α FusionBench's config sets after the merge (`svc_alpha_for`)
    parameters=(dataclasses.replace(SVC_ALPHA, default=None,
                                    help=SVC_ALPHA.help + " (default: FusionBench's α after the merge)"),),
))
