"""The parameters Surgery and ProbSurgery share (their declarations, and the call of `fit_surgery`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...merging.params import MergeParameter
from ..registry import PostMergingResult

_POSITIVE = (0.0, math.inf, True, True)
_COUNT = (1.0, math.inf, False, True)

LEARNING_RATE = MergeParameter("lr", float, 1e-3, "Adam's learning rate", interval=_POSITIVE)
TRAIN_BATCH_SIZE = MergeParameter("batch_size", int, 16, "examples per training step (per task)", interval=_COUNT)


def training_steps(default: int) -> MergeParameter:
    """The number of Adam steps per task, with the paper's `default`."""
    return MergeParameter("steps", int, default, "Adam steps per task's module", interval=_COUNT)


def fit(method: str, merged: Any, experts: Mapping[str, Any], calibration_data: Any, config: Any,
        processing_class: Any, device: Any, **parameters: Any) -> PostMergingResult:
    """`hf_featcal.post_merging.surgery.fit_surgery` with `method` and `parameters`, on the grid's
    calibration draw (`config`'s ``num_samples_per_task`` and ``seed``, as FeatCal draws); the merged
    model unchanged, with the per-task modules."""
    from ...config import FeatCalConfig
    from ..surgery import fit_surgery

    settings = config if config is not None else FeatCalConfig()
    # the draw (data_seed) is FeatCal's; the modules' init and batch order follow the same seed
    modules = fit_surgery(merged, experts, calibration_data, method=method, seed=settings.seed,
                          data_seed=settings.seed, num_samples_per_task=settings.num_samples_per_task,
                          max_length=settings.max_length, processing_class=processing_class, device=device,
                          **parameters)
    return PostMergingResult(merged, task_modules=modules)
