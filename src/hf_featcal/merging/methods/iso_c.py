"""Iso-C, isotropic merging in the common subspace (Marczak et al., ICML 2025, "No Task Left Behind:
Isotropic Model Merging with Common and Task-Specific Subspaces"): per weight matrix, the sum of the
task matrices with its singular values all replaced by their mean.  Iso-CTS
(`hf_featcal.merging.methods.iso_cts`) shares its scaling parameter and reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..params import SCALING_FACTOR, MergeMethod
from ..registry import get_method, register

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike

#: ``alpha`` of the isotropic merges: FusionBench's config default (the paper tunes it on validation data).
ISO_SCALING_FACTOR = dataclasses.replace(SCALING_FACTOR, default=1.0)
ISO_REFERENCE = ("Marczak et al., ICML 2025, \"No Task Left Behind: Isotropic Model Merging with Common and "
                 "Task-Specific Subspaces\"")


def iso_c_merging(base_model: ModelLike, experts: Mapping[str, ModelLike], scaling_factor: float = 1.0) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with Iso-C (Marczak et al. 2025).

    With ``T = len(experts)`` task vectors ``tau_i = theta_i - theta_0`` (float32), per tensor:

    * **2-D tensor**: ``M = tau_1 + ... + tau_T`` (Task Arithmetic's sum), its thin SVD
      ``M = U S Vᵀ`` over all ``r = min(m, n)`` singular values, and
      ``delta = mean(S) · U Vᵀ``: the same subspace, with an isotropic (flat) spectrum.
    * **any other tensor** (biases, norms, CLIP's patch-embedding convolution and class embedding):
      the mean ``M / T``.
    * ``theta = theta_0 + scaling_factor * delta``.

    Every floating-point 2-D tensor the experts share with the base takes the SVD rule, as in
    FusionBench (no ``exclude_keys`` by default): the Linear weights, the token and position
    embeddings, the LM head and the projections (tied tensors once).  An expert that lacks a tensor
    (a LoRA adapter that does not adapt it) counts as a zero task vector there.

    Only the triplets of nonzero singular value enter (``σ > max(σ) · max(m, n) · eps`` of float32,
    numpy's ``matrix_rank`` tolerance): when ``M`` is rank-deficient (LoRA experts) the flat spectrum
    is the mean over its nonzero singular values, on its own subspace.  The paper and FusionBench
    flatten all ``r``, so they also weight directions of zero singular value, which the SVD picks
    arbitrarily (they change with a permutation of the rows and columns); on a sum of full rank both
    are the same.

    Memory: besides the merged model, the ``T`` task matrices of one tensor at once (the engine
    hands them together), their sum and its SVD.

    Reference: FusionBench 0.2.33, ``IsotropicMergingInCommonSubspace``
    (``fusion_bench/method/isotropic_merging/iso.py``, ``iso_utils.py`` ``iso_c``; config
    ``scaling_factor: 1.0``).  Results agree within float32 rounding; where it differs:

    * it forms ``(M / T) · T`` before the SVD (the mean, scaled back); here ``M`` itself;
    * it runs the SVD in the checkpoint's dtype (so it fails for bf16 / fp16 weights); here always
      in float32, like the engine's task vectors;
    * the paper picks ``alpha`` on held-out validation data; 1.0 is FusionBench's default.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``alpha`` of the paper, in ``[-100, 100]``.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "iso_c", "scaling_factor": ...,
        "experts": [...]}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    from .._subspaces import isotropic_product, nonzero_svd, per_tensor_rule
    from ..engine import merge_task_vectors, sum_tensors, validate_experts

    (scaling_factor,) = get_method("iso_c").check(scaling_factor=scaling_factor)
    validate_experts(experts)  # before its names are taken

    def merge_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
        return isotropic_product(*nonzero_svd(sum_tensors(taus)))  # null-space directions are arbitrary: left out

    def mean(taus: list[torch.Tensor]) -> torch.Tensor:
        return sum_tensors(taus) / len(taus)  # FusionBench's order: the sum, then one division

    return merge_task_vectors(base_model, experts, "iso_c", {"scaling_factor": scaling_factor},
                              per_tensor_rule(list(experts), merge_matrix, mean), scaling_factor=scaling_factor)


METHOD = register(MergeMethod(
    "iso_c", iso_c_merging, summary="per matrix: the task sum's singular vectors with a flat spectrum",
    reference=ISO_REFERENCE
    + "; FusionBench fusion_bench.method.isotropic_merging.iso.IsotropicMergingInCommonSubspace",
    parameters=(ISO_SCALING_FACTOR,), paper_defaults={"scaling_factor": 1.0},
    svc_alpha=0.1,  # FusionBench's SVC config after this merge
))
