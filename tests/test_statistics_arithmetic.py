"""The exact-mode arithmetic savings (blocked upper-triangle Grams, cross moments without a teacher
tensor, the blocked CPU Cholesky) against brute-force float64 computations, at the widths where
they switch on (the tiny models of the other tests are narrower than that)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from hf_featcal._kernels.gemm import GRAM_KERNEL_VARIABLE, GRAM_KERNELS
from hf_featcal._kernels.gram import (
    BLOCKED_GRAM_MIN_DIM,
    add_upper_gram,
    gram_blocks,
    mirror_diagonal_blocks_,
    symmetric_from_upper,
    upper_gram_norm,
)
from hf_featcal.solver import BLOCKED_CHOLESKY_MIN_DIM, cholesky, gram_is_singular, symmetric_solve
from hf_featcal.statistics import LinearGroupStatistics, LinearTargets

F64 = torch.float64


def _brute_force(tasks, alpha, eps):
    """Σ s_i C_i, Σ s_i X_i W_iᵀ, Σ s_i (b_i + W_i μ_t), Σ s_i μ_s straight from the definitions."""
    gram = rhs = bias = mean = 0
    for t in tasks:
        w = t["w"] / t["w"].sum()
        x_t = (1 - alpha) * t["x_s"] + alpha * t["x_e"]
        c = (t["x_s"] * w[:, None]).T @ t["x_s"]
        s = 1.0 / max(float(torch.linalg.norm(c)), eps)
        x = (t["x_s"] * w[:, None]).T @ x_t
        gram = gram + s * c
        rhs = rhs + s * x @ t["weight"].T
        bias = bias + s * (t["bias"] + t["weight"] @ (w @ x_t))
        mean = mean + s * (w @ t["x_s"])
    return gram, rhs, bias, mean


def _tasks(generator, d, out, n=300, tasks=3, dtype=F64, weights="random"):
    """`weights`: "random" (and some padding) for every token, "unit" for every token (the Gram by
    syrk), "mixed": unit in the first half of the rows (`_accumulate`'s first batch), random after."""
    result = []
    for _ in range(tasks):
        x_s = torch.randn(n, d, generator=generator, dtype=F64) * (1 + torch.rand(d, generator=generator, dtype=F64))
        w = torch.rand(n, generator=generator, dtype=F64)
        w[::5] = 0.0  # padding
        if weights == "unit":
            w[:] = 1.0
        elif weights == "mixed":
            w[: n // 2] = 1.0
        result.append(dict(x_s=x_s.to(dtype),
                           x_e=(x_s + 0.3 * torch.randn(n, d, generator=generator, dtype=F64)).to(dtype), w=w.to(dtype),
                           weight=torch.randn(out, d, generator=generator, dtype=F64).to(dtype),
                           bias=torch.randn(out, generator=generator, dtype=F64).to(dtype)))
    return result


def _accumulate(tasks, alpha, direct, dtype=F64, eps=1e-8):
    d = tasks[0]["x_s"].shape[1]
    stats = LinearGroupStatistics(("m",), d, dtype=dtype, device=torch.device("cpu"), epsilon=eps, direct_rhs=direct)
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        half = t["x_s"].shape[0] // 2
        for rows in (slice(None, half), slice(half, None)):  # two batches shaped (B, N, d)
            stats.accumulate_mixture(t["x_s"][rows, None], t["x_e"][rows, None], alpha, t["w"][rows, None], target)
        stats.finish_task(target)
    return stats


def test_gram_blocks_cover_the_upper_triangle_once():
    assert gram_blocks(BLOCKED_GRAM_MIN_DIM - 1) == [(0, BLOCKED_GRAM_MIN_DIM - 1)]
    for dim, count in ((768, 4), (3072, 8), (2100, 7)):  # 2100: blocks of 320 (a multiple of 64)
        blocks = gram_blocks(dim)
        assert len(blocks) == count and blocks[0][0] == 0 and blocks[-1][1] == dim
        assert all(a[1] == b[0] for a, b in pairwise(blocks))
        assert all((stop - start) % 64 == 0 for start, stop in blocks[:-1])


@pytest.mark.parametrize("d, out, direct", [(600, 40, True), (600, 700, False), (2100, 50, True), (90, 20, False)])
@pytest.mark.parametrize(
    "alpha, weights", [(0.0, "random"), (0.25, "random"), (1.0, "random"), (0.25, "unit"), (0.25, "mixed")]
)
@pytest.mark.parametrize("kernel", GRAM_KERNELS)
def test_blocked_statistics_match_brute_force(generator, monkeypatch, d, out, direct, alpha, weights, kernel):
    """Every Gram path: blocked products (weighted tokens), unit weights' Gram by either kernel
    (syrk's triangle or the blocked products, `gemm.gram_kernel`), both in one task, and a Gram
    narrower than the blocked path's."""
    monkeypatch.setenv(GRAM_KERNEL_VARIABLE, kernel)
    tasks = _tasks(generator, d, out, n=200 if d > 1000 else 300, weights=weights)
    stats = _accumulate(tasks, alpha, direct)
    gram, rhs, bias, mean = _brute_force(tasks, alpha, 1e-8)
    torch.testing.assert_close(stats.gram_sum, gram, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.rhs_sum["m"], rhs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stats.bias_target_sum["m"], bias, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(stats.student_mean_sum, mean, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weights, kernel", [("random", "blocked"), ("unit", "syrk"), ("unit", "blocked")])
def test_float32_blocked_statistics_stay_within_float_precision(generator, monkeypatch, weights, kernel):
    """float32 accumulation of the blocked path and of syrk against the float64 definitions: float
    precision (the float32 inputs and sums alone give ~1e-5 here, before and after the blocked path)."""
    monkeypatch.setenv(GRAM_KERNEL_VARIABLE, kernel)
    tasks = _tasks(generator, 1100, 900, n=400, weights=weights)
    stats = _accumulate([{k: v.float() for k, v in t.items()} for t in tasks], 0.25, False, dtype=torch.float32)
    gram, rhs, _, _ = _brute_force(tasks, 0.25, 1e-8)
    assert float(torch.linalg.norm(stats.gram_sum.double() - gram) / torch.linalg.norm(gram)) < 1e-4
    assert float(torch.linalg.norm(stats.rhs_sum["m"].double() - rhs) / torch.linalg.norm(rhs)) < 1e-4


def test_upper_triangle_helpers(generator):
    x = torch.randn(50, 1500, generator=generator, dtype=F64)
    full = x.T @ x
    upper = full.clone()
    for r0, r1 in gram_blocks(1500):
        upper[r1:, r0:r1] = 0.0  # what add_upper_gram leaves below the block diagonal
    torch.testing.assert_close(symmetric_from_upper(upper), full, rtol=1e-13, atol=1e-11)
    assert upper_gram_norm(upper) == pytest.approx(float(torch.linalg.norm(full)), rel=1e-12)
    # syrk's layout: the diagonal blocks' halves below the diagonal stale, until mirrored
    stale = upper.clone()
    for r0, r1 in gram_blocks(1500):
        stale[r0:r1, r0:r1] = upper[r0:r1, r0:r1].triu() + torch.full((r1 - r0, r1 - r0), 7.0, dtype=F64).tril(-1)
    torch.testing.assert_close(symmetric_from_upper(mirror_diagonal_blocks_(stale)), full, rtol=1e-13, atol=1e-11)


def test_float32_gram_norm_is_exact_to_float_precision(generator):
    """s_i = 1/‖C_i‖_F from a float32 Gram 3072 wide (CLIP's fc2 input): exact to float precision
    against the float64 norm of the same float32 entries (torch's float32 norm of the whole matrix
    is 3.5e-4 off there)."""
    x = torch.randn(800, 3072, generator=generator)
    upper = torch.zeros(3072, 3072)
    add_upper_gram(upper, x, x)
    mirror_diagonal_blocks_(upper)
    full = symmetric_from_upper(upper).double()
    assert upper_gram_norm(upper) == pytest.approx(float(torch.linalg.norm(full)), rel=1e-6)


@pytest.mark.parametrize("n", [BLOCKED_CHOLESKY_MIN_DIM + 37, 1600])
def test_blocked_cholesky_is_the_cholesky_factor(generator, n):
    x = torch.randn(n + 200, n, generator=generator, dtype=F64)
    spd = x.T @ x / n
    factor, info = cholesky(spd)
    assert info == 0
    torch.testing.assert_close(factor, torch.linalg.cholesky(spd), rtol=1e-9, atol=1e-11)
    assert torch.equal(factor, factor.tril())
    # an indefinite matrix fails at the same pivot as LAPACK's
    broken = spd.clone()
    broken[n - 300, n - 300] = -1.0
    assert cholesky(broken)[1] == int(torch.linalg.cholesky_ex(broken).info)
    # the solver built on it: float32 solve ≤ 1e-5 of float64 lstsq; a rank-deficient Gram is singular
    rhs = torch.randn(n, 7, generator=generator, dtype=F64)
    solution, info = symmetric_solve(spd.float(), rhs.float())
    exact = torch.linalg.solve(spd, rhs)
    assert info.method == "cholesky"
    assert float(torch.linalg.norm(solution.double() - exact) / torch.linalg.norm(exact)) < 1e-4
    low_rank = x[: n // 2].T @ x[: n // 2]
    assert gram_is_singular(low_rank.float()) and not gram_is_singular(spd.float())


@pytest.mark.parametrize("low_pays", [True, False])
@pytest.mark.parametrize("direct", [False, True])
def test_fast_mode_products_stay_close_to_exact(generator, direct, low_pays, monkeypatch):
    """bf16 product factors (fast mode, where such products pay: `low_precision_products_pay`, forced
    here) with float32 sums: a Gram and right-hand side within a few bf16 roundings of exact float32,
    on the blocked path; the sums stay float32. Where they do not pay, the products are float32 ones,
    equal to exact mode's to float32 rounding."""
    import hf_featcal.statistics as statistics_module

    monkeypatch.setattr(statistics_module, "low_precision_products_pay", lambda dtype, device: low_pays)
    tasks = [{k: v.float() for k, v in t.items()} for t in _tasks(generator, 1100, 300 if direct else 900, n=400)]
    exact = _accumulate(tasks, 0.25, direct, dtype=torch.float32)
    fast = LinearGroupStatistics(("m",), 1100, dtype=torch.float32, device=torch.device("cpu"), epsilon=1e-8,
                                 direct_rhs=direct, product_dtype=torch.bfloat16)
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        fast.accumulate_mixture(t["x_s"][:, None], t["x_e"][:, None], 0.25, t["w"][:, None], target)
        fast.finish_task(target)
    assert fast.gram_sum.dtype == torch.float32 and fast.rhs_sum["m"].dtype == torch.float32
    for got, want in ((fast.gram_sum, exact.gram_sum), (fast.rhs_sum["m"], exact.rhs_sum["m"])):
        error = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
        if low_pays:
            assert 1e-5 < error < 2e-2  # bf16 has 8 bits of mantissa: ~4e-3 per rounding
        else:
            assert error < 1e-6


@pytest.mark.parametrize("n", [300, 1500])
def test_objective_decrease_from_the_factor_equals_the_gram_product(generator, n):
    """‖ΔL‖² with the solve's Cholesky factor (blocked when wide) equals tr(Δ H Δᵀ) from the Gram."""
    from hf_featcal.solver import linear_objective_decrease, solve_linear_weights

    x = torch.randn(n + 100, n, generator=generator, dtype=F64)
    gram = x.T @ x / n
    anchor = torch.randn(40, n, generator=generator, dtype=F64)
    (new,), info = solve_linear_weights(gram, [torch.randn(n, 40, generator=generator, dtype=F64)], [anchor], 0.05,
                                        1e-8)
    assert info.method == "cholesky" and info.factor is not None
    old = anchor + 0.1 * torch.randn(40, n, generator=generator, dtype=F64)
    want = linear_objective_decrease(gram, old, new, 0.05, 1e-8)
    assert linear_objective_decrease(gram, old, new, 0.05, 1e-8, factor=info.factor) == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_a_process_without_batches_of_a_task_reduces_the_same_sums(generator, direct, alpha):
    """In a multi-process run one process may hold no batch of a task: it must still hand the
    reduction the same list of tensors (count, shapes, dtypes) as a process with batches, or the
    collective would mismatch; its contribution is zeros."""
    tasks = _tasks(generator, 600, 40 if direct else 700, n=50, tasks=1)
    target = {"m": LinearTargets(tasks[0]["weight"], tasks[0]["bias"])}
    seen = []

    def recording(tensors):
        seen.append([(tuple(t.shape), t.dtype) for t in tensors])
        return [t * 2 if i else t + 1 for i, t in enumerate(tensors)]  # stands for the other process's sums

    kw = dict(dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=direct, teacher_alpha=alpha)
    busy = LinearGroupStatistics(("m",), 600, **kw)
    busy.accumulate_mixture(tasks[0]["x_s"][:, None], tasks[0]["x_e"][:, None], alpha, tasks[0]["w"][:, None], target)
    busy.finish_task(target, recording)
    idle = LinearGroupStatistics(("m",), 600, **kw)
    idle.finish_task(target, recording)
    assert seen[0] == seen[1]


def test_the_gram_sum_read_between_tasks_stays_the_sum_of_every_task(generator):
    """`gram_sum` mirrors the sum's lower blocks in place: a task folded after a read must still
    land in the next read (the mirror is redone from the upper blocks), and the per-task buffers
    reused from task to task must start each task at zero."""
    tasks = _tasks(generator, 600, 700, n=120, tasks=3)
    stats = LinearGroupStatistics(("m",), 600, dtype=F64, device=torch.device("cpu"), epsilon=1e-8)
    for count, t in enumerate(tasks, start=1):
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        stats.accumulate_mixture(t["x_s"][:, None], t["x_e"][:, None], 0.25, t["w"][:, None], target)
        stats.finish_task(target)
        gram, rhs, _, _ = _brute_force(tasks[:count], 0.25, 1e-8)
        torch.testing.assert_close(stats.gram_sum, gram, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(stats.rhs_sum["m"], rhs, rtol=1e-10, atol=1e-10)


def _spd(generator, n, dtype=F64):
    x = torch.randn(n + 50, n, generator=generator, dtype=F64)
    return (x.T @ x / n).to(dtype)


@pytest.mark.parametrize("n", [300, BLOCKED_CHOLESKY_MIN_DIM + 37])
def test_factorisations_in_a_work_matrix_leave_the_gram_alone(generator, n):
    """The solve stage factors in one reused work matrix: the Gram it reads is never changed, the
    answers are those of a fresh copy, and the factor handed back is the work matrix (blocked path)."""
    from hf_featcal.solver import cholesky_solve, shifted

    spd = _spd(generator, n)
    kept = spd.clone()
    work = torch.full_like(spd, float("nan"))  # whatever a previous user left
    rhs = torch.randn(n, 5, generator=generator, dtype=F64)
    solution, info = symmetric_solve(spd, rhs, shift=0.05, work=work)
    assert torch.equal(spd, kept)
    want = torch.linalg.solve(spd + 0.05 * torch.eye(n, dtype=F64), rhs)
    torch.testing.assert_close(solution, want, rtol=1e-9, atol=1e-10)
    fresh, _ = symmetric_solve(shifted(spd, 0.05), rhs)
    assert torch.equal(solution, fresh)
    if n >= BLOCKED_CHOLESKY_MIN_DIM:
        assert info.factor is work
    torch.testing.assert_close(info.factor @ info.factor.T, spd + 0.05 * torch.eye(n, dtype=F64), rtol=1e-9, atol=1e-10)
    # in place on request, and the two triangular solves equal torch's cholesky_solve (bit for bit
    # where MKL runs its Intel kernels; on an AMD EPYC potrs and two trsm calls round differently)
    own = shifted(spd, 0.05)
    factor, status = cholesky(own, out=own)
    assert status == 0 and (factor is own or n < BLOCKED_CHOLESKY_MIN_DIM)
    torch.testing.assert_close(cholesky_solve(rhs, factor), torch.cholesky_solve(rhs, factor), rtol=1e-12, atol=1e-12)
    # the singularity test in the same work matrix: same verdicts, Gram untouched
    low_rank = (lambda x: x.T @ x)(torch.randn(n // 2, n, generator=generator, dtype=F64))
    assert gram_is_singular(low_rank, work=work) and not gram_is_singular(spd, work=work)
    assert torch.equal(spd, kept)


def test_a_failed_factorisation_in_the_work_matrix_is_retried_from_the_gram(generator):
    """The first Cholesky overwrites the work matrix and fails: the damped retries and the
    least-squares fallback rebuild the system from the untouched Gram and its shift."""
    n = BLOCKED_CHOLESKY_MIN_DIM + 10
    singular = _spd(generator, n, torch.float32)
    singular[-1, -1] = -0.5  # indefinite: the factorisation fails at the last pivot, in its last block
    kept = singular.clone()
    rhs = torch.randn(n, 3, generator=generator, dtype=torch.float32)
    work = torch.empty_like(singular)
    got, info = symmetric_solve(singular, rhs, shift=0.0, work=work)
    want, want_info = symmetric_solve(singular.clone(), rhs)
    assert info.method == want_info.method == "cholesky+damping"
    assert torch.equal(singular, kept) and torch.equal(got, want)
    assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize("fail", [False, True])
def test_the_solve_stages_work_matrices_live_as_long_as_the_run(clip_setting, monkeypatch, fail):
    """`RunContext.workspace` matrices are handed out during calibrate() and dropped when it ends,
    also when it fails, so a calibrator kept afterwards holds none of them."""
    import copy

    import hf_featcal.pipeline.solve as solve_stage
    from hf_featcal import FeatCalCalibrator

    _, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), None, experts, data, show_progress=False)
    handed_out = []
    original = solve_stage.solve_linear_weights

    def solve(*args, **kwargs):
        handed_out.append(kwargs["work"])
        if fail:
            raise RuntimeError("stop here")
        return original(*args, **kwargs)

    monkeypatch.setattr(solve_stage, "solve_linear_weights", solve)
    if fail:
        with pytest.raises(RuntimeError, match="stop here"):
            calibrator.calibrate()
    else:
        calibrator.calibrate()
    assert handed_out and all(isinstance(w, torch.Tensor) for w in handed_out)
    assert calibrator.context._workspaces == {}
