"""Representation Surgery (Yang et al., ICML 2024, "Representation Surgery for Multi-Task Model Merging",
arXiv 2402.02705): per task t, the representation z the task's head reads becomes
z − U_t·ReLU(D_t·z) (rank r, no biases, U_t zero at the start: the identity), trained for a mean L1 to
the expert's representation of the same calibration input (`hf_featcal.post_merging.surgery`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...merging.params import MergeParameter
from ..registry import PostMergingResult, PostMergingStep, register_step
from ._surgery_params import LEARNING_RATE, TRAIN_BATCH_SIZE, fit, training_steps


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any, *, config: Any = None,
          processing_class: Any = None, device: Any = None, rank: int = 16, steps: int = 1000, lr: float = 1e-3,
          batch_size: int = 16) -> PostMergingResult:
    """One Surgery module per task on `merged`'s representation (the model itself unchanged)."""
    return fit("surgery", merged, experts, calibration_data, config, processing_class, device,
               rank=rank, steps=steps, lr=lr, batch_size=batch_size)


STEP = register_step(PostMergingStep(
    "surgery", apply, summary="per task, z − U·ReLU(D·z) on the head's representation, L1 to the expert's",
    reference="Yang et al., ICML 2024, \"Representation Surgery for Multi-Task Model Merging\" (arXiv 2402.02705)",
    fusionbench="fusion_bench.models.surgery.surgerymodelwrapper.SurgeryModelWrapper (on the normalised "
                "embedding, after AdaMerging)",
    parameters=(
        MergeParameter("rank", int, 16, "rank of D_t and U_t", interval=(1.0, math.inf, False, True)),
        training_steps(1000), LEARNING_RATE, TRAIN_BATCH_SIZE,
    ),
    paper_defaults={"rank": 16, "steps": 1000, "lr": 1e-3, "batch_size": 16},
    needs_calibration_data=True, per_task_modules=True,
))
