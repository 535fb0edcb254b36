"""Closed forms (statistics accumulators + solver) against brute-force least squares on random data."""

from __future__ import annotations

import math

import pytest
import torch

from hf_featcal.solver import (
    anchor,
    gram_is_singular,
    solve_layer_norm,
    solve_linear_bias,
    solve_linear_weight,
    solve_scale_only_norm,
    symmetric_solve,
)
from hf_featcal.statistics import LinearGroupStatistics, LinearTargets, NormStatistics

F64 = torch.float64


def _tasks(gen, num_tasks=3, d=6, out=4, tokens=(40, 25, 60), scales=(1.0, 5.0, 0.3)):
    """Random per-task student/expert inputs (two batches each), token weights and expert parameters."""
    tasks = []
    for i in range(num_tasks):
        n = tokens[i]
        x_s = scales[i] * torch.randn(n, d, generator=gen, dtype=F64)
        x_e = x_s + 0.3 * scales[i] * torch.randn(n, d, generator=gen, dtype=F64)
        w = torch.rand(n, generator=gen, dtype=F64)
        w[::7] = 0.0  # padding
        tasks.append(
            dict(
                x_s=x_s, x_e=x_e, w=w,
                weight=torch.randn(out, d, generator=gen, dtype=F64),
                bias=torch.randn(out, generator=gen, dtype=F64),
                gamma=1 + 0.2 * torch.randn(d, generator=gen, dtype=F64),
                beta=0.2 * torch.randn(d, generator=gen, dtype=F64),
            )
        )
    return tasks


def _linear_statistics(tasks, alpha, eps):
    d = tasks[0]["weight"].shape[1]
    stats = LinearGroupStatistics(("m",), d, dtype=F64, device=torch.device("cpu"), epsilon=eps)
    for t in tasks:
        x_t = alpha * t["x_e"] + (1 - alpha) * t["x_s"]
        half = t["x_s"].shape[0] // 2
        # two batches, shaped (B, N, d) like real activations
        stats.accumulate(t["x_s"][:half, None], x_t[:half, None], t["w"][:half, None])
        stats.accumulate(t["x_s"][half:, None], x_t[half:, None], t["w"][half:, None])
        stats.finish_task({"m": LinearTargets(t["weight"], t["bias"])})
    return stats


def _brute_force_linear(tasks, alpha, lam, eps, a_w, a_b):
    """Stack the weighted rows of every task and the ridge rows; solve with lstsq."""
    rows, targets, scales = [], [], []
    for t in tasks:
        x_t = alpha * t["x_e"] + (1 - alpha) * t["x_s"]
        wn = t["w"] / t["w"].sum()
        c = (t["x_s"] * wn[:, None]).T @ t["x_s"]
        s = 1.0 / max(float(torch.linalg.norm(c)), eps)
        scales.append(s)
        root = (s * wn).sqrt()[:, None]
        rows.append(root * t["x_s"])
        targets.append(root * (x_t @ t["weight"].T))
    d = a_w.shape[1]
    # ridge rows: LHS gets (λ+ε)I, RHS gets λ·Aᵀ, exactly as in the normal equations of the spec
    rows.append(math.sqrt(lam + eps) * torch.eye(d, dtype=F64))
    targets.append(lam / math.sqrt(lam + eps) * a_w.T)
    weight = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    # bias with W fixed: per output a weighted mean, again as a stacked least-squares problem
    design, goal = [], []
    for s, t in zip(scales, tasks, strict=True):
        x_t = alpha * t["x_e"] + (1 - alpha) * t["x_s"]
        wn = t["w"] / t["w"].sum()
        root = (s * wn).sqrt()[:, None]
        design.append(root)
        goal.append(root * (x_t @ t["weight"].T + t["bias"] - t["x_s"] @ weight.T))
    design.append(torch.full((1, 1), math.sqrt(lam), dtype=F64))
    goal.append(math.sqrt(lam) * a_b[None])
    bias = torch.linalg.lstsq(torch.cat(design), torch.cat(goal)).solution[0]
    return weight, bias


@pytest.mark.parametrize("alpha,lam", [(0.25, 0.05), (1.0, 0.0), (0.0, 2.0), (0.6, 0.5)])
def test_linear_weight_and_bias_equal_brute_force(generator, alpha, lam):
    eps = 1e-8
    tasks = _tasks(generator)
    a_w = torch.randn(4, 6, generator=generator, dtype=F64)
    a_b = torch.randn(4, generator=generator, dtype=F64)
    stats = _linear_statistics(tasks, alpha, eps)
    weight, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], a_w, lam, eps)
    bias = solve_linear_bias(weight, stats.bias_target_sum["m"], stats.student_mean_sum, stats.scale_sum, a_b, lam)
    ref_w, ref_b = _brute_force_linear(tasks, alpha, lam, eps, a_w, a_b)
    torch.testing.assert_close(weight, ref_w, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bias, ref_b, rtol=1e-9, atol=1e-9)


def test_task_scale_equalises_feature_scales(generator):
    tasks = _tasks(generator)
    stats = _linear_statistics(tasks, 0.25, 1e-8)
    for s, t in zip(stats.task_scales, tasks, strict=True):
        wn = t["w"] / t["w"].sum()
        c = (t["x_s"] * wn[:, None]).T @ t["x_s"]
        assert s == pytest.approx(1.0 / float(torch.linalg.norm(c)), rel=1e-12)


def test_huge_lambda_returns_the_anchor(generator):
    tasks = _tasks(generator)
    stats = _linear_statistics(tasks, 0.25, 1e-8)
    a_w = torch.randn(4, 6, generator=generator, dtype=F64)
    a_b = torch.randn(4, generator=generator, dtype=F64)
    weight, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], a_w, 1e12, 1e-8)
    bias = solve_linear_bias(weight, stats.bias_target_sum["m"], stats.student_mean_sum, stats.scale_sum, a_b, 1e12)
    torch.testing.assert_close(weight, a_w, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(bias, a_b, rtol=1e-8, atol=1e-8)


def test_one_expert_pure_teacher_no_ridge_returns_the_expert(generator):
    t = _tasks(generator, num_tasks=1)[0]
    t["x_e"] = t["x_s"].clone()  # student and expert inputs coincide
    stats = _linear_statistics([t], alpha=1.0, eps=1e-12)
    weight, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], torch.zeros(4, 6, dtype=F64), 1e-12, 1e-12)
    bias = solve_linear_bias(weight, stats.bias_target_sum["m"], stats.student_mean_sum, stats.scale_sum,
                             torch.zeros(4, dtype=F64), 1e-12)
    torch.testing.assert_close(weight, t["weight"], rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(bias, t["bias"], rtol=1e-7, atol=1e-7)


def _norm_statistics(tasks, centered, eps_ln=1e-5):
    d = tasks[0]["x_s"].shape[1]
    stats = NormStatistics("n", d, centered=centered, norm_eps=eps_ln, dtype=F64, device=torch.device("cpu"))
    for t in tasks:
        stats.accumulate(t["x_s"], t["w"])
        stats.finish_task(t["gamma"], t["beta"] if centered else None)
    return stats


@pytest.mark.parametrize("lam", [0.05, 0.0, 3.0])
def test_layer_norm_affine_equals_brute_force(generator, lam):
    tasks = _tasks(generator)
    d, eps_ln = 6, 1e-5
    a_g = 1 + 0.1 * torch.randn(d, generator=generator, dtype=F64)
    a_b = 0.1 * torch.randn(d, generator=generator, dtype=F64)
    stats = _norm_statistics(tasks, centered=True, eps_ln=eps_ln)
    gamma, beta = solve_layer_norm(
        stats.second_moment_sum, stats.mean_sum, stats.gamma_target_sum, stats.beta_target_sum,
        stats.num_tasks, a_g, a_b, lam, 1e-8,
    )
    for c in range(d):
        rows, goal = [], []
        for t in tasks:
            z = torch.nn.functional.layer_norm(t["x_s"], (d,), eps=eps_ln)[:, c]
            root = (t["w"] / t["w"].sum()).sqrt()
            rows.append(torch.stack([root * z, root], 1))
            goal.append(root * (t["gamma"][c] * z + t["beta"][c]))
        rows.append(torch.tensor([[math.sqrt(lam), 0.0], [0.0, math.sqrt(lam)]], dtype=F64))
        goal.append(math.sqrt(lam) * torch.stack([a_g[c], a_b[c]]))
        sol = torch.linalg.lstsq(torch.cat(rows), torch.cat(goal)[:, None]).solution[:, 0]
        assert float(gamma[c]) == pytest.approx(float(sol[0]), rel=1e-9, abs=1e-9)
        assert float(beta[c]) == pytest.approx(float(sol[1]), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("lam", [0.05, 0.0])
def test_rms_norm_scale_equals_brute_force(generator, lam):
    tasks = _tasks(generator)
    d = 6
    a_g = 1 + 0.1 * torch.randn(d, generator=generator, dtype=F64)
    stats = _norm_statistics(tasks, centered=False, eps_ln=1e-6)
    gamma = solve_scale_only_norm(stats.second_moment_sum, stats.gamma_target_sum, a_g, lam, 1e-8)
    for c in range(d):
        rows, goal = [], []
        for t in tasks:
            x = t["x_s"]
            z = (x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6))[:, c]
            root = (t["w"] / t["w"].sum()).sqrt()
            rows.append(root * z)
            goal.append(root * t["gamma"][c] * z)
        rows.append(torch.tensor([math.sqrt(lam)], dtype=F64))
        goal.append(math.sqrt(lam) * a_g[c : c + 1])
        sol = torch.linalg.lstsq(torch.cat(rows)[:, None], torch.cat(goal)[:, None]).solution[0, 0]
        assert float(gamma[c]) == pytest.approx(float(sol), rel=1e-9, abs=1e-9)


def test_anchor_formula():
    merged, base = torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0])
    torch.testing.assert_close(anchor(merged, base, 2.2), base + 2.2 * (merged - base))
    torch.testing.assert_close(anchor(merged, base, 1.0), merged)
    torch.testing.assert_close(anchor(merged, None, 2.2), merged)


def test_symmetric_solve_falls_back_on_singular_systems():
    lhs = torch.zeros(3, 3)
    lhs[0, 0] = 1.0
    solution, info = symmetric_solve(lhs, torch.ones(3, 2))
    assert info.method in {"cholesky+damping", "lstsq"}
    assert bool(torch.isfinite(solution).all())
    assert float(solution[0, 0]) == pytest.approx(1.0, rel=1e-3)


def test_gram_singularity_detection(generator):
    x = torch.randn(100, 5, generator=generator)
    assert not gram_is_singular(x.T @ x)
    x[:, 4] = x[:, 0] + x[:, 1]  # rank 4
    assert gram_is_singular(x.T @ x)
    x = torch.randn(100, 5, generator=generator)
    x[:, 2] = 0.0  # a dead input dimension
    assert gram_is_singular(x.T @ x)


# ε = 0.3: large enough that a decrease without its ε‖W‖² term shows at this tolerance
@pytest.mark.parametrize("alpha,lam,eps", [(0.25, 0.05, 1e-8), (1.0, 0.0, 1e-8), (0.6, 2.0, 1e-8), (0.25, 0.05, 0.3)])
def test_objective_decrease_equals_direct_evaluation(generator, alpha, lam, eps):
    """J(old) − J(new) from the statistics equals J = Σ s_i E_w‖W x_s − W_i x_t‖² + λ‖W − A‖² + ε‖W‖²
    evaluated on the raw rows (s_i from the rows too) at the old and the new weights."""
    from hf_featcal.solver import linear_objective_decrease

    tasks = _tasks(generator)
    stats = _linear_statistics(tasks, alpha, eps)
    a_w = torch.randn(4, 6, generator=generator, dtype=F64)
    new, _ = solve_linear_weight(stats.gram_sum, stats.rhs_sum["m"], a_w, lam, eps)

    def objective(w):
        total = lam * float((w - a_w).square().sum()) + eps * float(w.square().sum())
        for t in tasks:
            x_t = alpha * t["x_e"] + (1 - alpha) * t["x_s"]
            wn = t["w"] / t["w"].sum()
            s = 1.0 / max(float(torch.linalg.norm((t["x_s"] * wn[:, None]).T @ t["x_s"])), eps)
            total += s * float((wn * (t["x_s"] @ w.T - x_t @ t["weight"].T).square().sum(1)).sum())
        return total

    # a random start, and one close to the minimiser (a small decrease, where a wrong term shows most)
    for old in (torch.randn(4, 6, generator=generator, dtype=F64),
                new + 1e-3 * torch.randn(4, 6, generator=generator, dtype=F64)):
        got = linear_objective_decrease(stats.gram_sum, old, new, lam, eps)
        assert got == pytest.approx(objective(old) - objective(new), rel=1e-8)


def test_direct_right_hand_side_equals_cross_moment_path(generator):
    tasks = _tasks(generator, d=6, out=4)
    plain = _linear_statistics(tasks, 0.25, 1e-8)
    direct = LinearGroupStatistics(("m",), 6, dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    for t in tasks:
        x_t = 0.25 * t["x_e"] + 0.75 * t["x_s"]
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        direct.accumulate(t["x_s"][:, None], x_t[:, None], t["w"][:, None], target)
        direct.finish_task(target)
    torch.testing.assert_close(direct.rhs_sum["m"], plain.rhs_sum["m"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direct.gram_sum, plain.gram_sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direct.bias_target_sum["m"], plain.bias_target_sum["m"], rtol=1e-12, atol=1e-12)
