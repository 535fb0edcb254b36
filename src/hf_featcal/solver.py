"""FeatCal's closed forms. Pure tensor functions: no model knowledge, no hooks, no I/O.

Notation follows `featcal-method.md`: for task i, C_i = E_w[x_s x_sᵀ], X_i = E_w[x_s x_tᵀ],
μ_s,i = E_w[x_s], μ_t,i = E_w[x_t], s_i = 1 / max(‖C_i‖_F, ε); A is the anchor; λ the ridge.
Callers pass the task-summed quantities; every function returns new tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def task_scale(gram: Tensor, epsilon: float) -> float:
    """s_i = 1 / max(‖C_i‖_F, ε): puts tasks with different feature scales on an equal footing."""
    return 1.0 / max(float(torch.linalg.matrix_norm(gram, ord="fro")), epsilon)


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


def symmetric_solve(lhs: Tensor, rhs: Tensor, max_tries: int = 8) -> tuple[Tensor, SolveInfo]:
    """Solve `lhs @ X = rhs` for a symmetric positive (semi-)definite `lhs`.

    Cholesky first; if the factorisation fails, add a growing multiple of the mean diagonal and retry;
    as a last resort a least-squares solve. Never returns non-finite values without saying so: the
    caller checks the result.
    """
    factor, info = torch.linalg.cholesky_ex(lhs)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, factor), SolveInfo("cholesky")
    scale = float(lhs.diagonal().abs().mean()) or 1.0
    eye = torch.eye(lhs.shape[0], dtype=lhs.dtype, device=lhs.device)
    damping = scale * torch.finfo(lhs.dtype).eps * lhs.shape[0]
    for _ in range(max_tries):
        factor, info = torch.linalg.cholesky_ex(lhs + damping * eye)
        if int(info) == 0:
            return torch.cholesky_solve(rhs, factor), SolveInfo("cholesky+damping", damping)
        damping *= 10.0
    solution = torch.linalg.lstsq(lhs.cpu().double(), rhs.cpu().double()).solution
    return solution.to(dtype=lhs.dtype, device=lhs.device), SolveInfo("lstsq")


def solve_linear_weights(
    gram_sum: Tensor,
    rhs_sums: list[Tensor],
    anchor_weights: list[Tensor],
    lambda_ratio: float,
    epsilon: float,
) -> tuple[list[Tensor], SolveInfo]:
    """Weights of Linears that share one input (and so one Gram), with one factorisation:
    (Σ s_i C_i + (λ+ε) I) Wᵀ = Σ s_i X_i W_iᵀ + λ A_Wᵀ for every module.

    `gram_sum` is Σ s_i C_i (in×in); each `rhs_sums[k]` is Σ s_i X_i W_iᵀ (in×out_k).
    """
    lhs = gram_sum.clone()
    lhs.diagonal().add_(lambda_ratio + epsilon)
    rhs = torch.cat([r + lambda_ratio * a.T.to(r.dtype) for r, a in zip(rhs_sums, anchor_weights)], dim=1)
    solution, info = symmetric_solve(lhs, rhs)
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
) -> float:
    """J(old) − J(new) for the weight objective Σ s_i E‖W x_s − W_i x_t‖² + λ‖W − A‖² (+ ε‖W‖²),
    where `new_weight` is its minimiser.

    J is quadratic with Hessian H = Σ s_i C_i + (λ+ε) I, so J(W) − J(W*) = tr((W − W*) H (W − W*)ᵀ):
    exact from the statistics, without the teacher's own Gram, at the cost of one product.
    """
    delta = old_weight.to(gram_sum.dtype) - new_weight.to(gram_sum.dtype)
    return float(((delta @ gram_sum) * delta).sum() + (lambda_ratio + epsilon) * delta.square().sum())


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
    numerator = target_sum - weight.to(target_sum.dtype) @ student_mean_sum + lambda_ratio * anchor_bias.to(target_sum.dtype)
    return numerator / (scale_sum + lambda_ratio)


def solve_layer_norm(
    second_moment_sum: Tensor,
    mean_sum: Tensor,
    gamma_target_sum: Tensor,
    beta_target_sum: Tensor,
    num_tasks: int,
    anchor_gamma: Tensor,
    anchor_beta: Tensor,
    lambda_ratio: float,
    epsilon: float,
) -> tuple[Tensor, Tensor]:
    """LayerNorm affine (γ, β) per channel from the 2×2 system of the method.

    Inputs are task sums of e_i = E_w[z²], m_i = E_w[z], Σ(e_i γ_i + m_i β_i) and Σ(m_i γ_i + β_i).
    The determinant is clamped to at least ε.
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


def gram_is_singular(gram: Tensor, rtol: float = 1e-5) -> bool:
    """Cheap test for a numerically singular PSD Gram: a Cholesky pivot of `gram + δI` that is tiny.

    With δ well below `rtol`·max(diag), a null direction leaves a pivot of order δ; a well-conditioned
    Gram keeps every pivot of order its eigenvalues.
    """
    diag_max = float(gram.diagonal().max())
    if diag_max <= 0.0:
        return True
    if float(gram.diagonal().min()) <= rtol * diag_max:
        return True  # a dead (or nearly dead) input dimension
    # in the Gram's own dtype: float32 round-off (~1e-7 relative) sits well below `rtol`
    delta = 1e-3 * rtol * diag_max
    shifted = gram.clone()
    shifted.diagonal().add_(delta)
    factor, info = torch.linalg.cholesky_ex(shifted)
    if int(info) != 0:
        return True
    return float(factor.diagonal().square().min()) <= rtol * diag_max
