"""The linear algebra the subspace merges share (TSV-M, Iso-C, Iso-CTS in `hf_featcal.merging.methods`):
the per-tensor rule that sends 2-D tensors to a matrix rule and every other tensor to a mean, a
matrix's top singular triplets, the orthogonal (polar) factor of a matrix, blocks of triplets joined
and orthogonalised, and the isotropic product ``mean(s) · U Vᵀ``.

Torch is imported at the top: the method files import this module inside their functions only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import DeltaFn, Expert

__all__ = [
    "isotropic_product", "orthogonal_factor", "orthogonalised", "per_tensor_rule", "running_mean", "truncated_svd",
]

#: [tau_i of every expert, in the experts' order] -> the merged task vector of one tensor
TensorRule = Callable[[list[torch.Tensor]], torch.Tensor]


def running_mean(task_vectors: list[torch.Tensor]) -> torch.Tensor:
    """The mean of ``task_vectors``, updated one tensor at a time (``m += (tau_i - m) / i``): the order
    of operations of FusionBench's subspace merges, so that float32 results agree to the last bits."""
    mean = task_vectors[0].clone()
    for count, tau in enumerate(task_vectors[1:], start=2):
        mean += (tau - mean) / count
    return mean


def per_tensor_rule(
    expert_names: Sequence[str], matrix_rule: TensorRule, other_rule: TensorRule = running_mean
) -> DeltaFn:
    """The engine's ``delta_fn``: ``matrix_rule`` for a 2-D tensor, ``other_rule`` for any other shape,
    both given the task vectors of every expert in ``expert_names`` order.  An expert that lacks the
    tensor (e.g. a LoRA adapter that does not adapt it) enters with a zero task vector, which is what
    its model holds there (the base's value), so the number of tasks is the same for every tensor."""
    names = list(expert_names)

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        given = {expert.name: tau for expert, tau in task_vectors}
        like = task_vectors[0][1]
        taus = [given[name] if name in given else torch.zeros_like(like) for name in names]
        return matrix_rule(taus) if like.dim() == 2 else other_rule(taus)

    return delta


def orthogonal_factor(matrix: torch.Tensor) -> torch.Tensor:
    """``U Vᵀ`` from the thin SVD ``matrix = U S Vᵀ``: the matrix with orthonormal columns (or rows,
    for a wide one) nearest to ``matrix`` in Frobenius norm (orthogonal Procrustes)."""
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u @ vh


def truncated_svd(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U_k, s_k, V_kᵀ)``: the top ``rank`` singular triplets of ``matrix`` (thin SVD)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :rank], s[:rank], vh[:rank]


def orthogonalised(
    triplets: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several blocks of singular triplets joined: the concatenated left factors and right factors each
    replaced by their orthogonal factor, the spectra concatenated in the same order."""
    lefts, spectra, rights = zip(*triplets, strict=True)
    return (orthogonal_factor(torch.cat(lefts, dim=1)), torch.cat(spectra),
            orthogonal_factor(torch.cat(rights, dim=0)))


def isotropic_product(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """``U diag(s̄) Vᵀ`` with ``s̄`` the mean of ``s``: the spectrum flattened to its mean, which keeps
    the sum of the singular values (the nuclear norm when ``u`` and ``vh`` are orthonormal)."""
    return (u * s.mean()) @ vh
