"""The pooled-token weighting of a pooled-head stack's last block, applied inside the statistics
(`PooledWeighting`): every sum as o·(its every-token sum) + (1 − o)·(its pooled rows' sum), and q's
every-token sums taken from the k/v group's (`main_from`). Against brute-force float64 definitions
with the weights written out token by token, on every path the sums take (cross moment, direct
right-hand side projected or from the expert's outputs, unit and non-unit weights, per-head inputs,
o = 0 and o = 1, a process without batches), and in a whole CLIP calibration against a float64
reference."""

from __future__ import annotations

import pytest
import torch

from hf_featcal.statistics import LinearGroupStatistics, LinearTargets, PooledWeighting
from test_statistics_arithmetic import _brute_force

F64 = torch.float64
CPU = torch.device("cpu")


def _tasks(generator, d, out, batches=3, batch=4, tokens=5, heads=None, unit=False, tasks=2):
    """Tasks of `batches` batches shaped (batch, tokens[, heads], d), with per-token weights (batch, tokens)."""
    shape = (batch, tokens, *(() if heads is None else (heads,)), d)
    result = []
    for _ in range(tasks):
        task = {"x_s": [], "x_e": [], "w": []}
        for _ in range(batches):
            scale = 1 + torch.rand(d, generator=generator, dtype=F64)
            x_s = torch.randn(*shape, generator=generator, dtype=F64) * scale
            w = torch.rand(batch, tokens, generator=generator, dtype=F64)
            if unit:
                w = torch.ones_like(w)
            if not unit:
                w[:, -1] = 0.0  # padding
            task["x_s"].append(x_s)
            task["x_e"].append(x_s + 0.3 * torch.randn(*shape, generator=generator, dtype=F64))
            task["w"].append(w)
        task["weight"] = torch.randn(out, d, generator=generator, dtype=F64)
        task["bias"] = torch.randn(out, generator=generator, dtype=F64)
        result.append(task)
    return result


def _pooled_weights(w, index, other):
    factor = torch.full_like(w, other)
    factor[:, index] = 1.0
    return w * factor


def _flat(task, index, other, heads=None):
    """The task's tokens as rows, with the pooled weighting written out per token (the definition)."""
    rows = {}
    for key in ("x_s", "x_e"):
        rows[key] = torch.cat([x.reshape(-1, x.shape[-1]) for x in task[key]])
    weights = [_pooled_weights(w, index, other) for w in task["w"]]
    if heads is not None:
        weights = [w[..., None].expand(*w.shape, heads) for w in weights]
    rows["w"] = torch.cat([w.reshape(-1) for w in weights])
    return {**rows, "weight": task["weight"], "bias": task["bias"]}


def _run(tasks, pooled, alpha, direct=False, outputs=False, main=None):
    d = tasks[0]["x_s"][0].shape[-1]
    stats = LinearGroupStatistics(("m",), d, dtype=F64, device=CPU, epsilon=1e-8, direct_rhs=direct, pooled=pooled)
    stats.main_from = main
    groups = [g for g in (main, stats) if g is not None]
    for t in tasks:
        target = {"m": LinearTargets(t["weight"], t["bias"])}
        for x_s, x_e, w in zip(t["x_s"], t["x_e"], t["w"], strict=True):
            y = {"m": x_e @ t["weight"].T + t["bias"]} if outputs else None
            for group in groups:  # the main group first, as a block's groups are fed
                group.accumulate_mixture(x_s, x_e, alpha, w, {"m": target["m"]} if group is stats else {
                    name: target["m"] for name in group.modules}, y if group is stats else None)
        stats.finish_task(target)  # a group reading another's sums is folded first
        if main is not None:
            main.finish_task({name: target["m"] for name in main.modules})
    return stats


def _check(stats, tasks, alpha, index, other, heads=None):
    gram, rhs, bias, mean = _brute_force([_flat(t, index, other, heads) for t in tasks], alpha, 1e-8)
    torch.testing.assert_close(stats.gram_sum, gram, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(stats.rhs_sum["m"], rhs, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(stats.bias_target_sum["m"], bias, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(stats.student_mean_sum, mean, rtol=1e-11, atol=1e-13)
    weights = torch.cat([_flat(t, index, other, heads)["w"] for t in tasks])
    assert stats.weighted_tokens == int((weights > 0).sum())
    assert stats.effective_tokens == pytest.approx(float(weights.sum()), rel=1e-12)


@pytest.mark.parametrize("path", ["cross", "direct", "outputs"])
@pytest.mark.parametrize("alpha", [0.25, 0.0, 1.0])
def test_pooled_sums_equal_the_token_by_token_definition(generator, path, alpha):
    d, out = (6, 2) if path != "cross" else (6, 8)  # a direct right-hand side is taken for narrow outputs
    tasks = _tasks(generator, d, out)
    stats = _run(tasks, PooledWeighting(0, 0.01), alpha, direct=path != "cross", outputs=path == "outputs")
    _check(stats, tasks, alpha, 0, 0.01)


@pytest.mark.parametrize("other", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("index", [0, 2])
def test_any_other_token_weight_and_pooled_position(generator, other, index):
    tasks = _tasks(generator, 7, 3, unit=True)
    _check(_run(tasks, PooledWeighting(index, other), 0.25, direct=True, outputs=True), tasks, 0.25, index, other)
    _check(_run(tasks, PooledWeighting(index, other), 0.25), tasks, 0.25, index, other)


def test_wide_inputs_with_a_blocked_gram(generator):
    """640 wide: the Gram is a blocked upper triangle (and syrk on an Intel CPU for the unit weights)."""
    tasks = _tasks(generator, 640, 700, batches=2, batch=80, tokens=3, unit=True, tasks=2)
    _check(_run(tasks, PooledWeighting(0, 0.01), 0.25), tasks, 0.25, 0, 0.01)


def test_per_head_inputs(generator):
    tasks = _tasks(generator, 5, 4, heads=3)
    _check(_run(tasks, PooledWeighting(0, 0.01), 0.25), tasks, 0.25, 0, 0.01, heads=3)


@pytest.mark.parametrize("unit", [True, False])
def test_q_takes_the_key_value_groups_every_token_sums(generator, unit):
    """q beside k/v: its group adds only its pooled rows, the rest is the k/v group's sums; both
    groups' results equal their definitions (k/v with the tokens' own weights)."""
    tasks = _tasks(generator, 6, 8, unit=unit)
    main = LinearGroupStatistics(("k", "v"), 6, dtype=F64, device=CPU, epsilon=1e-8)
    calls = []
    original = main.accumulate_mixture

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    main.accumulate_mixture = spy  # type: ignore[method-assign]
    q = _run(tasks, PooledWeighting(0, 0.01), 0.25, main=main)
    _check(q, tasks, 0.25, 0, 0.01)
    _check_unweighted(main, tasks, 0.25, ("k", "v"))
    assert len(calls) == sum(len(t["x_s"]) for t in tasks)  # the k/v group saw every batch once


def _check_unweighted(main, tasks, alpha, names):
    gram, rhs, _, _ = _brute_force([_flat(t, 0, 1.0) for t in tasks], alpha, 1e-8)
    torch.testing.assert_close(main.gram_sum, gram, rtol=1e-11, atol=1e-13)
    for name in names:
        torch.testing.assert_close(main.rhs_sum[name], rhs, rtol=1e-11, atol=1e-13)


def test_a_q_group_does_not_run_the_products_of_its_every_token_sums(generator):
    """With `main_from` the weighted group's only products are its pooled rows'."""
    tasks = _tasks(generator, 6, 8, batches=2, batch=4, tokens=5, unit=True, tasks=1)
    main = LinearGroupStatistics(("k",), 6, dtype=F64, device=CPU, epsilon=1e-8)
    q = LinearGroupStatistics(("m",), 6, dtype=F64, device=CPU, epsilon=1e-8, pooled=PooledWeighting(0, 0.01))
    q.main_from = main
    seen = []
    original = q._add_batch

    def spy(x_s, *args):
        seen.append(x_s.shape[0])
        return original(x_s, *args)

    q._add_batch = spy  # type: ignore[method-assign]
    target = {"m": LinearTargets(tasks[0]["weight"], tasks[0]["bias"])}
    for x_s, x_e, w in zip(tasks[0]["x_s"], tasks[0]["x_e"], tasks[0]["w"], strict=True):
        main.accumulate_mixture(x_s, x_e, 0.25, w, {"k": target["m"]})
        q.accumulate_mixture(x_s, x_e, 0.25, w, target)
    assert seen == []
    q.finish_task(target)
    assert seen == [8]  # one product over the pooled rows of both batches


def test_a_process_without_batches_hands_zeros(generator):
    """A task none of whose batches this process holds: the pooled group folds zeros (its share of
    the cross-process sum), not an error."""
    q = LinearGroupStatistics(("m",), 4, dtype=F64, device=CPU, epsilon=1e-8, pooled=PooledWeighting(0, 0.01))
    seen = []

    def reduce(tensors):
        seen.extend(float(t.abs().sum()) for t in tensors)
        tensors[0].fill_(1.0)  # another process's weight total, so the fold goes on
        tensors[3].copy_(torch.eye(4, dtype=F64))
        return tensors

    q.finish_task({"m": LinearTargets(torch.randn(3, 4, generator=generator, dtype=F64), None)}, reduce)
    assert seen and all(value == 0.0 for value in seen)


def test_rows_are_kept_as_copies(generator):
    """The kept pooled rows do not hold the batch's memory (a view would keep a reused block alive)."""
    q = LinearGroupStatistics(("m",), 4, dtype=F64, device=CPU, epsilon=1e-8, pooled=PooledWeighting(0, 0.01))
    x = torch.randn(2, 3, 4, generator=generator, dtype=F64)
    q.accumulate_mixture(x, x + 1, 0.25, torch.ones(2, 3, dtype=F64),
                         {"m": LinearTargets(torch.randn(5, 4, generator=generator, dtype=F64), None)})
    for kept in q._pooled_rows[0][:3]:
        assert kept.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert kept.numel() == kept.untyped_storage().nbytes() // kept.element_size()
