"""benchmarks/bench_common.py's `ProductCount` (the side-by-side's count of both sides' arithmetic):
each product it counts against torch's own flop counter on the same or an equivalent out-of-place
product, and the side-by-side's account of two counts."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


side_by_side = _load("side_by_side_demo")  # (puts benchmarks/ on sys.path, where bench_common is)
ProductCount = side_by_side.ProductCount


def _torch_count(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def _ours(run) -> ProductCount:
    with ProductCount() as count:
        run()
    return count


def test_products_torch_counts_are_counted_as_torch_counts_them():
    a, b, bias = torch.randn(37, 19), torch.randn(19, 23), torch.randn(23)
    x, w = torch.randn(2, 3, 17, 17), torch.randn(5, 3, 4, 4)
    batched = torch.randn(4, 5, 6), torch.randn(4, 6, 7)

    def run():
        torch.mm(a, b)
        torch.addmm(bias, a, b)
        F.linear(a, b.T, bias)
        torch.bmm(*batched)
        F.conv2d(x, w, stride=2)

    assert _ours(run).total == _torch_count(run) > 0


def test_in_place_and_out_products_count_as_the_product_they_add():
    a, b = torch.randn(31, 12), torch.randn(12, 9)
    want = _torch_count(lambda: torch.addmm(torch.zeros(31, 9), a, b))
    acc, out = torch.zeros(31, 9), torch.empty(31, 9)
    assert _ours(lambda: acc.addmm_(a, b)).flop == {"addmm_": want}
    assert _ours(lambda: torch.mm(a, b, out=out)).flop == {"mm": want}
    assert _ours(lambda: torch.addmm(acc[0], a, b, out=out)).flop == {"addmm": want}
    # a transposed factor (the statistics' xᵀ·y) is the same product
    assert _ours(lambda: torch.zeros(12, 12).addmm_(a.T, a)).total == 2 * 12 * 31 * 12


def test_attention_counts_as_its_two_products():
    q, k, v = torch.randn(2, 3, 11, 8), torch.randn(2, 3, 13, 8), torch.randn(2, 3, 13, 8)
    fused = _ours(lambda: F.scaled_dot_product_attention(q, k, v))
    assert set(fused.flop) == {"_scaled_dot_product_flash_attention_for_cpu"}  # torch's fused CPU kernel

    def by_hand():
        torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)

    assert fused.total == _torch_count(by_hand) == 2 * 6 * 11 * 13 * (8 + 8)
    with sdpa_kernel(SDPBackend.MATH):  # torch's unfused path: its products, counted one by one
        assert _ours(lambda: F.scaled_dot_product_attention(q, k, v)).total == fused.total


def test_vector_products_count_one_multiply_add_per_matrix_entry():
    m, v, u = torch.randn(7, 5), torch.randn(5), torch.randn(7)
    count = _ours(lambda: (torch.mv(m, v), torch.zeros(7).addmv_(m, v), torch.zeros(7, 5).addr_(u, v)))
    assert count.flop == {"mv": 70, "addmv_": 70, "addr_": 70}


def test_solves_are_listed_not_counted():
    spd = torch.eye(6) * 3 + 0.1
    count = _ours(lambda: (torch.linalg.cholesky(spd), torch.linalg.solve(spd, torch.randn(6, 2))))
    assert count.total == 0
    assert count.solver_calls and all("check" not in name for name in count.solver_calls)
    assert "linalg_cholesky_ex" in count.solver_calls


def test_element_wise_work_is_not_counted():
    x = torch.randn(50, 40)
    assert _ours(lambda: (x * 2 + 1).sigmoid().sum()).total == 0


def test_the_account_gives_the_ratio_and_each_rounds_rates():
    counts = {"demo": {"flop": 26.8e12}, "hf_featcal": {"flop": 16.0e12}}
    rounds = [{"demo": {"seconds": 200.0}, "hf_featcal": {"seconds": 125.0}},
              {"demo": {"seconds": 268.0}, "hf_featcal": {"seconds": 160.0}}]
    account = side_by_side.products_summary(counts, rounds)
    assert account["ratio"] == pytest.approx(26.8 / 16.0)
    assert account["gflop_per_s"] == [pytest.approx({"demo": 134.0, "hf_featcal": 128.0}),
                                      pytest.approx({"demo": 100.0, "hf_featcal": 100.0})]
    text = side_by_side.products_text({**account, "demo": {"flop": 26.8e12, "by_op": {"mm": 26.8e12}},
                                       "hf_featcal": {"flop": 16.0e12, "by_op": {"addmm_": 16.0e12}}})
    assert "1.675×" in text and "134.0 GFLOP/s" in text and "round 2" in text
