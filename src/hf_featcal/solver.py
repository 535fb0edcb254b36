"""FeatCal's closed forms. Pure tensor functions: no model knowledge, no hooks, no I/O.

Notation follows docs/how-featcal-works.md (steps 3–4): for task i, C_i = E_w[x_s x_sᵀ], X_i = E_w[x_s x_tᵀ],
μ_s,i = E_w[x_s], μ_t,i = E_w[x_t], s_i = 1 / max(‖C_i‖_F, ε); A is the anchor; λ the ridge.
Callers pass the task-summed quantities; every function returns new tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor


def task_scale(gram_norm: float, epsilon: float) -> float:
    """s_i = 1 / max(‖C_i‖_F, ε), from the Frobenius norm ‖C_i‖_F: puts tasks with different feature
    scales on an equal footing."""
    return 1.0 / max(gram_norm, epsilon)


def anchor(merged: Tensor, base: Tensor | None, rho: float) -> Tensor:
    """A = base + ρ·(merged − base); the merged tensor itself when there is no base."""
    if base is None:
        return merged.clone()
    return base + rho * (merged - base)


@dataclass
class SolveInfo:
    """How a symmetric system was solved (for logging and warnings)."""

    method: str  # "cholesky", "cholesky+damping" or "lstsq"
    damping: float = 0.0
    #: the lower Cholesky factor of the undamped system matrix (method "cholesky" only), reused by
    #: `linear_objective_decrease` instead of another product with the Gram
    factor: Tensor | None = field(default=None, repr=False)


#: From this size on, CPU factorisations are blocked (LAPACK's unblocked-looking potrf runs far below
#: the matmul rate with few threads); below it, or on accelerators, torch's own is used.
BLOCKED_CHOLESKY_MIN_DIM = 1024
_CHOLESKY_BLOCK = 384


def cholesky(lhs: Tensor, out: Tensor | None = None) -> tuple[Tensor, int]:
    """Lower Cholesky factor of a symmetric matrix (its lower triangle is read) and LAPACK's info
    (0: success, else the order of the first non-positive leading minor). On CPU, large matrices are
    factored by blocks of 384 (right-looking): each diagonal block by LAPACK, the panel below it by
    a triangular solve, and the lower triangle of the trailing matrix updated block row by block row
    with matrix products — the same factor, with most of the arithmetic in matmuls.

    `out`: a matrix of `lhs`'s shape the blocked factorisation works in (it may be `lhs` itself,
    factored in place); the factor is then `out`. Without it (and on the unblocked path) the factor
    is a new tensor."""
    n = lhs.shape[0]
    if lhs.device.type != "cpu" or n < BLOCKED_CHOLESKY_MIN_DIM:
        factor, info = torch.linalg.cholesky_ex(lhs)
        return factor, int(info)
    if out is None:
        work = lhs.tril()
    else:
        work = out if out is lhs else out.copy_(lhs)
        work.tril_()
    edges = list(range(0, n, _CHOLESKY_BLOCK)) + [n]
    for k, (start, stop) in enumerate(pairwise(edges)):
        diagonal, info = torch.linalg.cholesky_ex(work[start:stop, start:stop])
        if int(info) != 0:
            return work, start + int(info)
        work[start:stop, start:stop] = diagonal
        if stop == n:
            break
        # the panel L21 = A21 L11⁻ᵀ, then A22 −= L21 L21ᵀ on the lower triangle's block rows only; the
        # panel as (L11⁻¹ A21ᵀ)ᵀ: a left-side triangular solve runs ~3× faster than a right-side one
        panel = torch.linalg.solve_triangular(diagonal, work[stop:, start:stop].T, upper=False).T
        work[stop:, start:stop] = panel
        for row0, row1 in pairwise(edges[k + 1 :]):
            rows = panel[row0 - stop : row1 - stop]
            work[row0:row1, stop:row1].addmm_(rows, panel[: row1 - stop].T, alpha=-1.0)
    return work, 0


def cholesky_solve(rhs: Tensor, factor: Tensor) -> Tensor:
    """X with L Lᵀ X = rhs for a lower factor L: the two triangular solves LAPACK's potrs makes (the
    same result bit for bit on an Intel Xeon, to rounding on an AMD EPYC, where MKL's kernels differ),
    without `torch.cholesky_solve`'s column-major copy of L."""
    return torch.linalg.solve_triangular(factor.T, torch.linalg.solve_triangular(factor, rhs, upper=False), upper=True)


def shifted(matrix: Tensor, shift: float, out: Tensor | None = None) -> Tensor:
    """matrix + shift·I, as a new tensor or written into `out` (a matrix of the same shape)."""
    result = matrix.clone() if out is None else out.copy_(matrix)
    if shift:
        result.diagonal().add_(shift)
    return result


def symmetric_solve(
    lhs: Tensor, rhs: Tensor, max_tries: int = 8, *, shift: float = 0.0, work: Tensor | None = None
) -> tuple[Tensor, SolveInfo]:
    """Solve `(lhs + shift·I) @ X = rhs` for a symmetric positive (semi-)definite `lhs`.

    Cholesky first; if the factorisation fails, add a growing multiple of the mean diagonal and retry;
    as a last resort a least-squares solve. Never returns non-finite values without saying so: the
    caller checks the result. `lhs` is not changed. `work`: a matrix of `lhs`'s shape and dtype the
    factorisation may overwrite instead of allocating one (`SolveInfo.factor` is then `work`, valid
    until `work` is used again).
    """
    system = shifted(lhs, shift, work)
    factor, info = cholesky(system, out=system)
    if info == 0:
        return cholesky_solve(rhs, factor), SolveInfo("cholesky", factor=factor)
    scale = float((lhs.diagonal() + shift).abs().mean()) or 1.0
    damping = scale * torch.finfo(lhs.dtype).eps * lhs.shape[0]
    for _ in range(max_tries):
        system = shifted(lhs, shift, work)
        system.diagonal().add_(damping)
        factor, info = cholesky(system, out=system)
        if info == 0:
            return cholesky_solve(rhs, factor), SolveInfo("cholesky+damping", damping)
        damping *= 10.0
    system = shifted(lhs, shift)
    solution = torch.linalg.lstsq(system.cpu().double(), rhs.cpu().double()).solution
    return solution.to(dtype=lhs.dtype, device=lhs.device), SolveInfo("lstsq")


def solve_linear_weights(
    gram_sum: Tensor,
    rhs_sums: list[Tensor],
    anchor_weights: list[Tensor],
    lambda_ratio: float,
    epsilon: float,
    work: Tensor | None = None,
) -> tuple[list[Tensor], SolveInfo]:
    """Weights of Linears that share one input (and so one Gram), with one factorisation:
    (Σ s_i C_i + (λ+ε) I) Wᵀ = Σ s_i X_i W_iᵀ + λ A_Wᵀ for every module.

    `gram_sum` is Σ s_i C_i (in×in, not changed); each `rhs_sums[k]` is Σ s_i X_i W_iᵀ (in×out_k);
    `work` as in `symmetric_solve`.
    """
    # (the anchor transposed into a contiguous copy first: an add reading it transposed is ~3× slower)
    rhs = torch.cat(
        [
            torch.add(r, a.T.to(r.dtype).contiguous(), alpha=lambda_ratio)
            for r, a in zip(rhs_sums, anchor_weights, strict=True)
        ],
        dim=1,
    )
    solution, info = symmetric_solve(gram_sum, rhs, shift=lambda_ratio + epsilon, work=work)
    widths = [r.shape[1] for r in rhs_sums]
    return [part.T.contiguous() for part in torch.split(solution, widths, dim=1)], info


def solve_linear_weight(
    gram_sum: Tensor,
    rhs_sum: Tensor,
    anchor_weight: Tensor,
    lambda_ratio: float,
    epsilon: float,
) -> tuple[Tensor, SolveInfo]:
    """Weight of one Linear (out×in): (Σ s_i C_i + (λ+ε) I) Wᵀ = Σ s_i X_i W_iᵀ + λ A_Wᵀ."""
    (weight,), info = solve_linear_weights(gram_sum, [rhs_sum], [anchor_weight], lambda_ratio, epsilon)
    return weight, info


def linear_objective_decrease(
    gram_sum: Tensor,
    old_weight: Tensor,
    new_weight: Tensor,
    lambda_ratio: float,
    epsilon: float,
    factor: Tensor | None = None,
) -> float:
    """J(old) − J(new) for the weight objective Σ s_i E‖W x_s − W_i x_t‖² + λ‖W − A‖² (+ ε‖W‖²),
    where `new_weight` is its minimiser.

    J is quadratic with Hessian H = Σ s_i C_i + (λ+ε) I, so J(W) − J(W*) = tr((W − W*) H (W − W*)ᵀ):
    exact from the statistics, without the teacher's own Gram, at the cost of one product. Given
    H's lower Cholesky factor L (`SolveInfo.factor`), it is ‖(W − W*) L‖²: a product with a
    triangular matrix, computed by column blocks at about half the arithmetic.
    """
    delta = old_weight.to(gram_sum.dtype) - new_weight.to(gram_sum.dtype)
    if factor is not None:
        return float(lower_triangular_product(delta, factor).square().sum())
    return float(((delta @ gram_sum) * delta).sum() + (lambda_ratio + epsilon) * delta.square().sum())


def lower_triangular_product(a: Tensor, lower: Tensor) -> Tensor:
    """a @ lower for a lower-triangular `lower`, skipping its zero blocks (column blocks of 384)."""
    n = lower.shape[0]
    if n < BLOCKED_CHOLESKY_MIN_DIM:
        return a @ lower
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    for start in range(0, n, 384):
        stop = min(start + 384, n)
        torch.mm(a[:, start:], lower[start:, start:stop], out=out[:, start:stop])
    return out


def solve_linear_bias(
    weight: Tensor,
    target_sum: Tensor,
    student_mean_sum: Tensor,
    scale_sum: float,
    anchor_bias: Tensor,
    lambda_ratio: float,
) -> Tensor:
    """Bias of a Linear given its new weight W.

    b = [Σ s_i (b_i + W_i μ_t,i − W μ_s,i) + λ A_b] / (Σ s_i + λ), with `target_sum` = Σ s_i (b_i + W_i μ_t,i)
    and `student_mean_sum` = Σ s_i μ_s,i.
    """
    numerator = (
        target_sum - weight.to(target_sum.dtype) @ student_mean_sum + lambda_ratio * anchor_bias.to(target_sum.dtype)
    )
    return numerator / (scale_sum + lambda_ratio)


def solve_layer_norm(
    second_moment_sum: Tensor,
    mean_sum: Tensor,
    gamma_target_sum: Tensor,
    beta_target_sum: Tensor,
    num_tasks: float,
    anchor_gamma: Tensor,
    anchor_beta: Tensor,
    lambda_ratio: float,
    epsilon: float,
) -> tuple[Tensor, Tensor]:
    """LayerNorm affine (γ, β) per channel from the 2×2 system of the method.

    Inputs are task sums of e_i = E_w[z²], m_i = E_w[z], Σ(e_i γ_i + m_i β_i) and Σ(m_i γ_i + β_i);
    `num_tasks` is T (with task weights ω_i, every sum weighted and T = Σ ω_i). The determinant is
    clamped to at least ε.
    """
    a11 = second_moment_sum + lambda_ratio
    a12 = mean_sum
    a22 = num_tasks + lambda_ratio
    r1 = gamma_target_sum + lambda_ratio * anchor_gamma.to(gamma_target_sum.dtype)
    r2 = beta_target_sum + lambda_ratio * anchor_beta.to(beta_target_sum.dtype)
    det = (a11 * a22 - a12 * a12).clamp_min(epsilon)
    gamma = (a22 * r1 - a12 * r2) / det
    beta = (a11 * r2 - a12 * r1) / det
    return gamma, beta


def solve_scale_only_norm(
    second_moment_sum: Tensor,
    gamma_target_sum: Tensor,
    anchor_gamma: Tensor,
    lambda_ratio: float,
    epsilon: float,
) -> Tensor:
    """Scale of an RMS norm (or a bias-free LayerNorm): γ = (Σ e_i γ_i + λ A_γ) / (Σ e_i + λ).

    The denominator is floored at ε so a dead channel with λ = 0 cannot divide by zero.
    """
    numerator = gamma_target_sum + lambda_ratio * anchor_gamma.to(gamma_target_sum.dtype)
    return numerator / (second_moment_sum + lambda_ratio).clamp_min(epsilon)


#: Relative size below which a Gram's pivot counts as zero, and below which the ridge counts as too
#: weak to set the solution in the Gram's null directions (`ridge_settles_null_directions`).
SINGULAR_RTOL = 1e-5


def ridge_settles_null_directions(gram: Tensor, shift: float, rtol: float = SINGULAR_RTOL) -> bool:
    """Whether the ridge `shift` (λ + ε) alone keeps `gram + shift·I` well conditioned, whatever the
    Gram's rank: shift ≥ `rtol`·‖gram‖_F. Its condition number is (σ_max + shift) / (σ_min + shift) ≤
    (‖gram‖_F + shift) / shift ≤ 1 + 1/`rtol`, so the solve stays accurate (float32: ≲ 1e5 · 6e-8) and a
    direction the data leave undetermined is set by the ridge, towards the anchor, as the method
    intends: a singular Gram then changes nothing worth a warning. Below, such a direction is set
    by ε and round-off. (FeatCal's task scaling makes ‖gram‖_F at most the number of tasks, so the
    default λ = 0.05 settles them for up to 5,000 tasks.)"""
    return shift >= rtol * float(torch.linalg.matrix_norm(gram))


def gram_is_singular(gram: Tensor, rtol: float = SINGULAR_RTOL, work: Tensor | None = None) -> bool:
    """Cheap test for a numerically singular PSD Gram: a Cholesky pivot of `gram + δI` that is tiny.

    With δ well below `rtol`·max(diag), a null direction leaves a pivot of order δ; a well-conditioned
    Gram keeps every pivot of order its eigenvalues. `work`: a matrix of the Gram's shape and dtype
    the factorisation may overwrite (`gram` itself is not changed).
    """
    diag_max = float(gram.diagonal().max())
    if diag_max <= 0.0:
        return True
    if float(gram.diagonal().min()) <= rtol * diag_max:
        return True  # a dead (or nearly dead) input dimension
    # in the Gram's own dtype: float32 round-off (~1e-7 relative) sits well below `rtol`
    system = shifted(gram, 1e-3 * rtol * diag_max, work)
    factor, info = cholesky(system, out=system)
    if info != 0:
        return True
    return float(factor.diagonal().square().min()) <= rtol * diag_max
