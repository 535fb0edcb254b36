"""Iso-CTS, isotropic merging in common and task-specific subspaces (Marczak et al., ICML 2025, "No Task
Left Behind: Isotropic Model Merging with Common and Task-Specific Subspaces"): per weight matrix, the
top singular directions of the task sum (the common subspace) completed by each task's own top
directions outside it, orthogonalised together, with a flat spectrum.  Iso-C is
`hf_featcal.merging.methods.iso_c`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..params import MergeMethod, MergeParameter
from ..registry import get_method, register
from .iso_c import ISO_REFERENCE, ISO_SCALING_FACTOR

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike


def iso_cts_merging(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 1.0,
    common_space_fraction: float = 0.8,
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with Iso-CTS (Marczak et al. 2025).

    With ``T = len(experts)`` task vectors ``tau_i = theta_i - theta_0`` (float32), per tensor:

    * **2-D tensor** (``m x n``, ``r = min(m, n)``):

      1. Sizes (`subspace_sizes`): ``c0 = int(r * common_space_fraction)``, the task-specific total
         ``t = round((r - c0) / T) * T`` (Python's round, half to even; less ``T`` if that exceeds
         ``r``), the common size ``c = r - t`` and ``p = t / T`` directions per task.
      2. Common subspace: the thin SVD of ``M = tau_1 + ... + tau_T``, its first ``c`` triplets
         ``(U_c, S_c, V_c)``.
      3. Task-specific subspaces: per task, the thin SVD of the residual
         ``tau_i - U_c U_cᵀ tau_i`` (the part outside the common subspace), its first ``p``
         triplets ``(U_i, S_i, V_i)``.
      4. ``U = [U_1 ... U_T U_c]`` and ``V = [V_1 ... V_T V_c]`` (``r`` columns each) replaced by
         their orthogonal factors (``polar(A) = P Qᵀ`` for ``A = P Σ Qᵀ``), the spectrum by the mean
         ``s̄`` of ``[S_1 ... S_T S_c]``: ``delta = s̄ · polar(U) polar(V)ᵀ``.

      ``common_space_fraction = 1`` gives ``c = r``, ``p = 0``: Iso-C.  As in Iso-C, only triplets
      of nonzero singular value are kept (``σ > max(σ) · max(m, n) · eps`` of float32; for a residual
      relative to ``‖tau_i‖_F``): a rank-deficient sum (LoRA experts) or a task whose residual is zero
      brings fewer than ``c`` or ``p`` directions, and the flat spectrum is the mean over the kept
      ones.  The paper and FusionBench keep all of them, so the flat spectrum also weights directions
      of zero singular value, which the SVD picks arbitrarily (they change with a permutation of the
      rows and columns); on matrices of full rank both keep the same triplets.
    * **any other tensor** (biases, norms, CLIP's patch-embedding convolution and class embedding):
      the mean of the ``tau_i``.
    * ``theta = theta_0 + scaling_factor * delta``.

    Every floating-point 2-D tensor the experts share with the base takes the subspace rule, as in
    FusionBench (no ``exclude_keys`` by default): the Linear weights, the token and position
    embeddings, the LM head and the projections (tied tensors once).  An expert that lacks a tensor
    (a LoRA adapter that does not adapt it) counts as a zero task vector there.

    Memory: besides the merged model, the ``T`` task matrices of one tensor at once (the engine
    hands them together), their sum, one residual and the kept factors (about one ``m x r`` and one
    ``r x n`` matrix), and the SVD workspace.

    Reference: FusionBench 0.2.33, ``IsotropicMergingInCommonAndTaskSubspace``
    (``fusion_bench/method/isotropic_merging/iso.py``, ``iso_utils.py`` ``iso_cts``; config
    ``scaling_factor: 1.0``, ``common_space_fraction: 0.8``).  The same float32 SVDs, so results
    agree within float32 rounding; where it differs:

    * the residual is ``tau_i - U_c (U_cᵀ tau_i)``; FusionBench forms the ``m x m`` projector
      ``U_c U_cᵀ`` first (the same value, more memory and rounding);
    * when ``t`` exceeds ``r`` (a small ``common_space_fraction``, or ``r`` below ``T / 2``) it
      fails (a negative common size); here ``t`` drops by ``T``;
    * it runs the SVDs in the checkpoint's dtype (so it fails for bf16 / fp16 weights); here always
      in float32, like the engine's task vectors;
    * the paper picks ``alpha`` on held-out validation data; 1.0 is FusionBench's default.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``alpha`` of the paper, in ``[-100, 100]``.
        common_space_fraction: Share of the rank given to the common subspace, in ``[0, 1]``
            (the paper's 0.8).

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "iso_cts", "scaling_factor": ...,
        "common_space_fraction": ..., "experts": [...]}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    import torch

    from .._subspaces import isotropic_product, orthogonalised, per_tensor_rule, truncated_svd
    from ..engine import merge_task_vectors, sum_tensors, validate_experts

    scaling_factor, common_space_fraction = get_method("iso_cts").check(
        scaling_factor=scaling_factor, common_space_fraction=common_space_fraction
    )
    validate_experts(experts)  # before its names are taken

    def merge_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
        common, per_task = subspace_sizes(min(taus[0].shape), len(taus), common_space_fraction)
        common_part = truncated_svd(sum_tensors(taus), common)
        common_u = common_part[0]
        # each task's top directions outside the common subspace, then the common ones
        # (nonzero singular values only, relative to the task matrix: a residual that is rounding keeps none)
        task_parts = [truncated_svd(tau - common_u @ (common_u.T @ tau), per_task, float(torch.linalg.norm(tau)))
                      for tau in taus]
        return isotropic_product(*orthogonalised([*task_parts, common_part]))

    params = {"scaling_factor": scaling_factor, "common_space_fraction": common_space_fraction}
    return merge_task_vectors(base_model, experts, "iso_cts", params, per_tensor_rule(list(experts), merge_matrix),
                              scaling_factor=scaling_factor)


def subspace_sizes(rank: int, tasks: int, common_space_fraction: float) -> tuple[int, int]:
    """``(common, per_task)`` directions of a rank-``rank`` matrix merged from ``tasks`` tasks, with
    ``common + tasks * per_task = rank`` (the task-specific part divisible by the task count)."""
    common = int(rank * common_space_fraction)
    task_specific = round((rank - common) / tasks) * tasks
    if task_specific > rank:  # rounded up past the rank (FusionBench fails here)
        task_specific -= tasks
    return rank - task_specific, task_specific // tasks


METHOD = register(MergeMethod(
    "iso_cts", iso_cts_merging,
    summary="per matrix: common + task-specific singular subspaces, orthogonalised, flat spectrum",
    reference=ISO_REFERENCE
    + "; FusionBench fusion_bench.method.isotropic_merging.iso.IsotropicMergingInCommonAndTaskSubspace",
    parameters=(
        ISO_SCALING_FACTOR,
        MergeParameter("common_space_fraction", float, 0.8, "share of each matrix's rank given to the common "
                       "subspace (the rest is split evenly among the tasks)", interval=(0.0, 1.0, False, False)),
    ),
    paper_defaults={"scaling_factor": 1.0, "common_space_fraction": 0.8},
    svc_alpha=0.2,  # FusionBench's SVC config after this merge
))
