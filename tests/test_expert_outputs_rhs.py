"""The down projections' right-hand side from the expert modules' own outputs (y_e = W_i x_e + b_i),
taken when a task has more weighted tokens than the input is wide: against brute-force float64
definitions, against the projected path, across processes that chose differently, and in a whole
calibration (float64) against the same run forced onto the projected path."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal._kernels.gram import gram_blocks, symmetric_upper_product
from hf_featcal.statistics import LinearGroupStatistics, LinearTargets
from test_statistics_arithmetic import _brute_force, _tasks
from testing_utils import build_clip_setting

F64 = torch.float64


def _outputs(t, bias=True):
    return t["x_e"] @ t["weight"].T + (t["bias"] if bias else 0.0)


def _run(tasks, alpha, from_outputs, bias=True, dtype=F64):
    """Accumulate and fold `tasks` (two batches each), with or without the expert outputs."""
    d = tasks[0]["x_s"].shape[1]
    stats = LinearGroupStatistics(("m",), d, dtype=dtype, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"] if bias else None)}
        half = t["x_s"].shape[0] // 2
        for rows in (slice(None, half), slice(half, None)):
            y = {"m": _outputs(t, bias)[rows, None]} if from_outputs else None
            stats.accumulate_mixture(t["x_s"][rows, None], t["x_e"][rows, None], alpha, t["w"][rows, None], target, y)
        stats.finish_task(target)
    return stats


@pytest.mark.parametrize("alpha", [0.25, 0.0, 1.0])
@pytest.mark.parametrize("d", [6, 640])  # 640: the Gram is kept as a blocked upper triangle
def test_right_hand_side_from_outputs_equals_the_definition(generator, alpha, d):
    tasks = _tasks(generator, d=d, out=5, n=2 * d + 40)
    gram, rhs, bias, mean = _brute_force(tasks, alpha, 1e-8)
    stats = _run(tasks, alpha, from_outputs=True)
    torch.testing.assert_close(stats.rhs_sum["m"], rhs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.gram_sum, gram, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.bias_target_sum["m"], bias, rtol=1e-10, atol=1e-12)
    projected = _run(tasks, alpha, from_outputs=False)
    torch.testing.assert_close(stats.rhs_sum["m"], projected.rhs_sum["m"], rtol=1e-11, atol=1e-13)


def test_a_linear_without_bias(generator):
    tasks = _tasks(generator, d=6, out=3, n=50)
    for t in tasks:
        t["bias"] = torch.zeros_like(t["bias"])
    _, rhs, _, _ = _brute_force(tasks, 0.25, 1e-8)
    torch.testing.assert_close(_run(tasks, 0.25, from_outputs=True, bias=False).rhs_sum["m"], rhs, rtol=1e-10,
                               atol=1e-12)


def test_float32_paths_agree_to_float_precision(generator):
    tasks = _tasks(generator, d=640, out=96, n=1400, tasks=2, dtype=torch.float32)
    outputs = _run(tasks, 0.25, True, dtype=torch.float32).rhs_sum["m"].double()
    projected = _run(tasks, 0.25, False, dtype=torch.float32).rhs_sum["m"].double()
    exact = _run([{k: v.double() for k, v in t.items()} for t in tasks], 0.25, True).rhs_sum["m"]
    assert float((outputs - exact).norm() / exact.norm()) < 3e-6
    assert float((projected - exact).norm() / exact.norm()) < 3e-6


def test_processes_may_choose_differently(generator):
    """One process takes the outputs, the other projects; after the reduction the sums equal one
    process holding every batch (each process turns its sums into the same quantity first)."""
    tasks = _tasks(generator, d=6, out=4, n=60)
    whole = _run(tasks, 0.25, from_outputs=True)
    rows_a, rows_b = (slice(0, 20), slice(20, 35)), (slice(35, 60),)
    # process b's raw per-task sums, captured at its reduction, are added into process a's
    captured = []
    d = 6
    proc_b = LinearGroupStatistics(("m",), d, dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    proc_a = LinearGroupStatistics(("m",), d, dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        for rows in rows_b:
            proc_b.accumulate_mixture(t["x_s"][rows, None], t["x_e"][rows, None], 0.25, t["w"][rows, None], target)
        proc_b.finish_task(target, lambda ts: captured.append([x.clone() for x in ts]) or ts)
        for rows in rows_a:
            y = {"m": _outputs(t)[rows, None]}
            proc_a.accumulate_mixture(t["x_s"][rows, None], t["x_e"][rows, None], 0.25, t["w"][rows, None], target, y)
        proc_a.finish_task(target, lambda ts: [x + y for x, y in zip(ts, captured[-1], strict=True)])
    torch.testing.assert_close(proc_a.rhs_sum["m"], whole.rhs_sum["m"], rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(proc_a.gram_sum, whole.gram_sum, rtol=1e-11, atol=1e-13)


def test_one_task_takes_one_path(generator):
    t = _tasks(generator, d=6, out=4, n=20, tasks=1)[0]
    target = {"m": LinearTargets(t["weight"], t["bias"])}
    stats = LinearGroupStatistics(("m",), 6, dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    stats.accumulate_mixture(t["x_s"][:10, None], t["x_e"][:10, None], 0.25, t["w"][:10, None], target,
                             {"m": _outputs(t)[:10, None]})
    with pytest.raises(ValueError, match="bring the expert's outputs, or none"):
        stats.accumulate_mixture(t["x_s"][10:, None], t["x_e"][10:, None], 0.25, t["w"][10:, None], target)
    crossed = LinearGroupStatistics(("m",), 6, dtype=F64, device=torch.device("cpu"), epsilon=1e-8)
    with pytest.raises(ValueError, match="direct right-hand sides only"):
        crossed.accumulate_mixture(t["x_s"][:, None], t["x_e"][:, None], 0.25, t["w"][:, None], target,
                                   {"m": _outputs(t)[:, None]})


def test_when_the_outputs_pay():
    def stats(dim, direct=True, low=None):
        return LinearGroupStatistics(("m",), dim, dtype=torch.float32, device=torch.device("cpu"), epsilon=1e-8,
                                     direct_rhs=direct, product_dtype=low)

    fc2 = stats(3072)  # CLIP ViT-B/32's down projection
    assert not fc2.expert_outputs_pay(32 * 50, 0.25)  # 32 images of 50 tokens: project the tokens
    assert fc2.expert_outputs_pay(256 * 50, 0.25)  # the paper's 256 per task
    assert not fc2.expert_outputs_pay(3072, 0.25) and fc2.expert_outputs_pay(3073, 0.25)  # above d tokens
    assert fc2.expert_outputs_pay(1, 1.0)  # α = 1: always (no student term)
    assert fc2.expert_outputs_pay(1537, 0.0) and not fc2.expert_outputs_pay(1536, 0.0)  # α = 0: above d/2
    assert not stats(3072, direct=False).expert_outputs_pay(10**6, 0.25)
    assert not stats(3072, low=torch.bfloat16).expert_outputs_pay(10**6, 0.25)  # fast mode projects


def test_symmetric_upper_product(generator):
    for d in (7, 640, 2100):
        x = torch.randn(d + 5, d, generator=generator, dtype=F64)
        full = x.T @ x
        upper = full.clone()
        for r0, r1 in gram_blocks(d):
            upper[r1:, r0:r1] = float("nan")  # below the block diagonal: never read
        b = torch.randn(d, 3, generator=generator, dtype=F64)
        torch.testing.assert_close(symmetric_upper_product(upper, b), full @ b, rtol=1e-12, atol=1e-9)


def _calibrate(merged, base, experts, data, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, FeatCalConfig(**config),
                                 show_progress=False).calibrate()


def test_a_calibration_takes_the_outputs_with_the_same_result(generator, monkeypatch):
    """The tiny CLIP's fc2 (32 wide) sees 4 × 5 × 5 tokens per task: its right-hand side comes from
    the expert's outputs. In float64 the weights equal those of the same run forced to project."""
    base, experts, merged, data = build_clip_setting(generator)
    base, merged = base.double(), merged.double()
    experts = {t: e.double() for t, e in experts.items()}
    data = {t: [{k: v.double() for k, v in b.items()} for b in batches] for t, batches in data.items()}
    seen = []
    original = LinearGroupStatistics.accumulate_mixture

    def spy(self, *args):
        seen.append((self.modules, len(args) > 5 and args[5] is not None))
        return original(self, *args)

    monkeypatch.setattr(LinearGroupStatistics, "accumulate_mixture", spy)
    taken = _calibrate(merged, base, experts, data, compute_dtype="float64")
    assert {modules for modules, from_outputs in seen if from_outputs} == {("mlp.fc2",)}
    monkeypatch.setattr(LinearGroupStatistics, "expert_outputs_pay", lambda self, tokens, alpha: False)
    seen.clear()
    projected = _calibrate(merged, base, experts, data, compute_dtype="float64")
    assert not any(from_outputs for _, from_outputs in seen)
    changed = 0
    for (name, p), (_, q), (_, m) in zip(taken.named_parameters(), projected.named_parameters(),
                                         merged.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
        changed += not torch.equal(p, m)
    assert changed >= 10
    for expert in experts.values():  # the output hooks are gone
        assert not any(m._forward_hooks for m in expert.modules())


def test_the_projected_path_reuses_its_scratch(generator):
    """On the CPU the teacher inputs and each module's right-hand-side sum are written into matrices
    kept across batches and tasks (a fresh one is page-faulted in again each time); the sums still
    equal the definition, so each task's sum starts from zero."""
    tasks = _tasks(generator, d=6, out=3, n=60)
    stats = LinearGroupStatistics(("m",), 6, dtype=F64, device=torch.device("cpu"), epsilon=1e-8, direct_rhs=True)
    buffers = set()
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        for rows in (slice(None, 40), slice(40, None)):  # a larger batch, then a smaller one
            stats.accumulate_mixture(t["x_s"][rows, None], t["x_e"][rows, None], 0.25, t["w"][rows, None], target)
            buffers.add((stats._teacher.data_ptr(), stats._rhs_task["m"].data_ptr()))
        stats.finish_task(target)
    assert len(buffers) == 1
    _, rhs, bias, _ = _brute_force(tasks, 0.25, 1e-8)
    torch.testing.assert_close(stats.rhs_sum["m"], rhs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stats.bias_target_sum["m"], bias, rtol=1e-10, atol=1e-12)
