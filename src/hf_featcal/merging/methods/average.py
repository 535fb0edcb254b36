"""Averaging the experts' weights (the uniform "model soup" of Wortsman et al., ICML 2022): Task
Arithmetic with ``scaling_factor = 1 / len(experts)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..params import MergeMethod
from ..registry import register

if TYPE_CHECKING:
    from torch import nn

    from ...model_io import ModelLike


def simple_average(base_model: ModelLike, experts: Mapping[str, ModelLike]) -> nn.Module:
    """Average the experts' weights: Task Arithmetic with ``scaling_factor = 1 / len(experts)``.

    Equivalent to ``theta_m = mean_i theta_i`` on every shared floating-point tensor; tensors of
    the base that the experts do not cover keep the base weights.  Inputs (models, or local folders /
    hub ids) are not modified.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "simple_average",
        "scaling_factor": 1/n, "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping or mismatched architectures.
    """
    from ..engine import merge_task_vectors, sum_delta, validate_base, validate_experts

    validate_base(base_model)
    validate_experts(experts)  # before its length is taken
    scaling_factor = 1.0 / len(experts)
    return merge_task_vectors(base_model, experts, "simple_average", {"scaling_factor": scaling_factor}, sum_delta,
                              scaling_factor=scaling_factor)


METHOD = register(MergeMethod(
    "average", simple_average, summary="the mean of the experts",
    reference="Wortsman et al., ICML 2022, \"Model soups\" (the uniform soup)",
    aliases=("simple_average",),
    svc_alpha=0.1,  # FusionBench's SVC config after this merge
))
