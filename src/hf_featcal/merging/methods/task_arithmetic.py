"""Task Arithmetic (Ilharco et al., ICLR 2023, "Editing Models with Task Arithmetic"):
``theta = theta_0 + lambda * sum_i tau_i``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..params import SCALING_FACTOR, MergeMethod
from ..registry import get_method, register

if TYPE_CHECKING:
    from torch import nn

    from ...model_io import ModelLike


def task_arithmetic(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 0.3,
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with Task Arithmetic.

    ``theta_m = theta_0 + scaling_factor * sum_i (theta_i - theta_0)`` on every floating-point
    state-dict tensor the experts share with the base model.

    Args:
        base_model: The pre-trained model the experts were fine-tuned from (a ``PreTrainedModel``),
            or its local folder / hub id.  It is not modified.
        experts: Mapping task name -> fine-tuned model (or local folder / hub id, read lazily) of the
            same architecture, or of a sub-module of the base (e.g. ``CLIPVisionModel`` experts for a
            ``CLIPModel`` base: only the vision tower is merged).  Not modified.
        scaling_factor: The task-vector scaling ``lambda``, in ``[-100, 100]``.

    Returns:
        A new model holding the merged weights, with
        ``config.hf_featcal_merge = {"method": "task_arithmetic", "scaling_factor": ..., "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping, a ``scaling_factor`` outside its range, a
            source that cannot be loaded, an expert whose configuration, state-dict keys or shapes do not
            line up with the base, non-finite weights, or a non-finite merge.
    """
    from ..engine import merge_task_vectors, sum_delta

    (scaling_factor,) = get_method("task_arithmetic").check(scaling_factor=scaling_factor)
    return merge_task_vectors(base_model, experts, "task_arithmetic", {"scaling_factor": scaling_factor}, sum_delta,
                              scaling_factor=scaling_factor)


METHOD = register(MergeMethod(
    "task_arithmetic", task_arithmetic, summary="theta_0 + λ·(sum of the task vectors)",
    reference="Ilharco et al., ICLR 2023, \"Editing Models with Task Arithmetic\"",
    parameters=(SCALING_FACTOR,), paper_defaults={"scaling_factor": 0.3},
    svc_alpha=0.1,  # FusionBench's SVC config after this merge
))
