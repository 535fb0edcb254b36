"""TSV-M, Task Singular Vectors merging (Gargiulo et al., CVPR 2025, "Task Singular Vectors: Reducing
Task Interference in Model Merging"): per weight matrix, each task keeps its top ``1/T`` singular
triplets; the kept left and right singular vectors of all tasks are orthogonalised together (their
nearest orthonormal bases) before the low-rank parts are summed."""

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
    from ..engine import Expert


def tsv_merging(base_model: ModelLike, experts: Mapping[str, ModelLike], scaling_factor: float = 1.0) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with TSV-M (Gargiulo et al. 2025).

    With ``T = len(experts)`` task vectors ``tau_i = theta_i - theta_0`` (float32), per tensor:

    * **2-D tensor** ``tau_i`` (``m x n``, ``r = min(m, n)``): the thin SVD ``tau_i = U_i S_i V_iᵀ``
      cut to its first ``k = r // T`` triplets; concatenated over the tasks in the experts' order,
      ``U = [U_1[:, :k] ... U_T[:, :k]]`` (``m x kT``), ``S`` likewise, ``V = [V_1[:, :k] ... V_T[:, :k]]``;
      each basis replaced by its orthogonal factor (``polar(A) = P Qᵀ`` for ``A = P Σ Qᵀ``, the nearest
      matrix with orthonormal columns); then ``delta = polar(U) diag(S) polar(V)ᵀ``.  Only triplets
      with a nonzero singular value are kept: ``σ > max(σ) · max(m, n) · eps`` (float32's eps, the
      tolerance of numpy's ``matrix_rank``), so a task matrix of rank below ``k`` (a LoRA expert's
      ``B A``, or zero where the expert left the tensor as the base) brings only its rank's worth of
      triplets, and no arbitrary null-space direction enters the orthogonalisation: two LoRA experts
      on disjoint modules merge to each adapter's own delta on its modules.  ``k = 0`` (``r < T``)
      gives ``delta = 0``: the tensor keeps the base's value, with a warning naming the tensors.
    * **any other tensor** (biases, norms, CLIP's patch-embedding convolution and class embedding):
      the mean of the ``tau_i``.
    * ``theta = theta_0 + scaling_factor * delta``.

    Every floating-point 2-D tensor the experts share with the base goes through the SVD rule, as
    in FusionBench (no ``exclude_keys`` by default): the Linear weights, and also the token and
    position embeddings, the LM head and the projections (tied tensors once).  An expert that
    lacks a tensor (a LoRA adapter that does not adapt it) counts as a zero task vector there.

    Memory: besides the merged model, the ``T`` task matrices of one tensor at once (the engine
    hands them together), their kept factors (at most one ``m x r`` and one ``r x n`` matrix) and
    the SVD workspace.

    Reference: FusionBench 0.2.33, ``TaskSingularVectorMerging``
    (``fusion_bench/method/task_singular_vector/TSVM.py``, ``utils/TSVM_utils.py``
    ``compute_and_sum_svd_mem_reduction``; config ``alpha: 1``).  The same float32 SVDs in the same
    order, so results agree within float32 rounding.  Where it differs:

    * ``k = r // T``; FusionBench takes ``int(r * (1 / T))``, one less for some ``T`` >= 49 (e.g.
      ``r = T = 49`` gives 0 there), a float rounding of the paper's ``r / T``.
    * It pads ``U`` and ``V`` with zero columns / rows up to ``r`` when ``kT < r``; they carry zero
      singular values, so leaving them out (as here) gives the same ``delta``.
    * It keeps all ``k`` triplets of each task, also those of zero singular values of a rank-deficient
      task matrix, whose arbitrary singular vectors its orthogonalisation mixes into the other tasks'
      (67 % off one adapter's delta for two rank-2 experts on disjoint modules of the tests' tiny Llama, 80 %
      changed by a permutation of rows and columns). On task matrices of
      full rank (every kept σ above the tolerance) both keep the same triplets.
    * Its per-task ``alpha`` list (scaling each ``tau_i`` before the SVDs) is not offered; a single
      ``alpha`` is ``scaling_factor``.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``alpha`` of the paper (its 1.0 is not tuned on validation data), in ``[-100, 100]``.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "tsv_m", "scaling_factor": ...,
        "experts": [...]}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    import warnings

    import torch

    from .._subspaces import orthogonalised, per_tensor_rule, truncated_svd
    from ..engine import merge_task_vectors, validate_experts

    (scaling_factor,) = get_method("tsv_m").check(scaling_factor=scaling_factor)
    validate_experts(experts)  # before its names are taken

    def merge_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
        kept = min(taus[0].shape) // len(taus)
        if kept == 0:
            return torch.zeros_like(taus[0])
        # only triplets of nonzero singular values (truncated_svd): null-space directions would be mixed in
        u_all, spectrum, vh_all = orthogonalised([truncated_svd(tau, kept) for tau in taus])
        return (u_all * spectrum) @ vh_all

    rule = per_tensor_rule(list(experts), merge_matrix)
    base_kept: list[str] = []

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        if task_vectors[0][1].dim() == 2 and min(task_vectors[0][1].shape) < len(experts):
            base_kept.append(key)
        return rule(key, task_vectors)

    merged = merge_task_vectors(base_model, experts, "tsv_m", {"scaling_factor": scaling_factor}, delta,
                                scaling_factor=scaling_factor)
    if base_kept:
        warnings.warn(
            f"TSV-M: {len(base_kept)} matrices have a rank min(m, n) below the {len(experts)} experts and keep the "
            f"base model's value (k = rank // {len(experts)} = 0 triplets per task): {base_kept[:10]}"
            + (f" and {len(base_kept) - 10} more" if len(base_kept) > 10 else ""),
            UserWarning, stacklevel=2,
        )
    return merged


METHOD = register(MergeMethod(
    "tsv_m", tsv_merging, summary="per matrix: top 1/T singular triplets of each task, orthogonalised, summed",
    reference="Gargiulo et al., CVPR 2025, \"Task Singular Vectors: Reducing Task Interference in Model Merging\"; "
              "FusionBench fusion_bench.method.task_singular_vector.TSVM.TaskSingularVectorMerging",
    parameters=(dataclasses.replace(SCALING_FACTOR, default=1.0),),
    paper_defaults={"scaling_factor": 1.0},
    svc_alpha=1.0,  # FusionBench's SVC config after this merge
))
