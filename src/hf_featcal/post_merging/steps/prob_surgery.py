"""ProbSurgery (Wei et al., ICML 2025, "Representation Surgery in Model Merging with Probabilistic
Modeling"), written from the paper's formulas: per task, s = ReLU(A_t·z), μ = M_t·s, log σ² = V_t·s;
training subtracts one sample μ + ε·σ (loss: mean L1 to the expert's representation + kl_weight ·
KL(N(μ, σ²) ‖ N(0, I))), inference subtracts μ (`hf_featcal.post_merging.surgery`). ``shared``: one
module for every task (no task needed at inference)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...merging.params import MergeParameter
from ..registry import PostMergingResult, PostMergingStep, register_step
from ._surgery_params import LEARNING_RATE, TRAIN_BATCH_SIZE, fit, training_steps


def apply(merged: Any, base: Any, experts: Mapping[str, Any], calibration_data: Any, *, config: Any = None,
          processing_class: Any = None, device: Any = None, hidden: int = 128, steps: int = 5000,
          lr: float = 1e-3, batch_size: int = 16, kl_weight: float = 1e-4, shared: bool = False) -> PostMergingResult:
    """One ProbSurgery module per task (or one shared) on `merged`'s representation (the model unchanged)."""
    return fit("prob_surgery", merged, experts, calibration_data, config, processing_class, device,
               hidden=hidden, steps=steps, lr=lr, batch_size=batch_size, kl_weight=kl_weight, shared=shared)


STEP = register_step(PostMergingStep(
    "prob_surgery", apply,
    summary="per task, z − μ(z) of a learnt Gaussian correction (a sample while training), L1 + KL",
    reference="Wei et al., ICML 2025, \"Representation Surgery in Model Merging with Probabilistic Modeling\"",
    parameters=(
        MergeParameter("hidden", int, 128, "width of s = ReLU(A·z)", interval=(1.0, math.inf, False, True)),
        training_steps(5000), LEARNING_RATE, TRAIN_BATCH_SIZE,
        MergeParameter("kl_weight", float, 1e-4, "weight of KL(N(μ, σ²) ‖ N(0, I)) in the loss",
                       interval=(0.0, math.inf, False, True)),
        MergeParameter("shared", bool, False, "one module for every task (no task needed at inference)"),
    ),
    paper_defaults={"hidden": 128, "steps": 5000, "lr": 1e-3, "batch_size": 16, "kl_weight": 1e-4},
    needs_calibration_data=True, per_task_modules=True,
))
