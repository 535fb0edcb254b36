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
    "isotropic_product", "nonzero_rank", "nonzero_svd", "orthogonal_factor", "orthogonalised", "per_tensor_rule",
    "running_mean", "truncated_svd",
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


def nonzero_rank(spectrum: torch.Tensor, shape: tuple[int, ...], scale: float | None = None) -> int:
    """How many of the singular values ``spectrum`` (descending) of an ``m x n`` matrix are nonzero:
    above ``scale · max(m, n) · eps`` of their dtype, with ``scale`` the largest singular value (the
    tolerance of numpy's ``matrix_rank``) unless given (a matrix computed from a larger one, whose
    rounding is relative to that one's scale). Below it a singular value is rounding, and its singular
    vectors are arbitrary directions of the null space: the SVD picks them by its own internals, so
    they change with a permutation of the matrix's rows or columns."""
    if spectrum.numel() == 0:
        return 0
    reference = float(spectrum[0]) if scale is None else scale
    return int((spectrum > reference * max(shape) * torch.finfo(spectrum.dtype).eps).sum())


def nonzero_svd(matrix: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD ``(U, s, Vᵀ)`` of ``matrix`` cut to its triplets of nonzero singular value (`nonzero_rank`)."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    kept = nonzero_rank(s, tuple(matrix.shape), scale)
    return u[:, :kept], s[:kept], vh[:kept]


def truncated_svd(
    matrix: torch.Tensor, rank: int, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U_k, s_k, V_kᵀ)``: the top ``rank`` singular triplets of ``matrix`` (thin SVD) that carry a
    nonzero singular value (`nonzero_rank`, relative to ``scale``): fewer than ``rank`` for a matrix of
    lower rank (a LoRA expert's task matrix, or the zero matrix of an expert that left the tensor
    unchanged)."""
    u, s, vh = nonzero_svd(matrix, scale)
    return u[:, :rank], s[:rank], vh[:rank]


def orthogonalised(
    triplets: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several blocks of singular triplets joined: the concatenated left factors and right factors each
    replaced by their orthogonal factor, the spectra concatenated in the same order."""
    lefts, spectra, rights = zip(*triplets, strict=True)
    left, spectrum, right = torch.cat(lefts, dim=1), torch.cat(spectra), torch.cat(rights, dim=0)
    if spectrum.numel() == 0:  # no triplet at all (every block empty): nothing to orthogonalise
        return left, spectrum, right
    return orthogonal_factor(left), spectrum, orthogonal_factor(right)


def isotropic_product(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """``U diag(s̄) Vᵀ`` with ``s̄`` the mean of ``s``: the spectrum flattened to its mean, which keeps
    the sum of the singular values (the nuclear norm when ``u`` and ``vh`` are orthonormal); zero for
    no triplets."""
    if s.numel() == 0:
        return u @ vh  # (m x 0) @ (0 x n): zeros
    return (u * s.mean()) @ vh
