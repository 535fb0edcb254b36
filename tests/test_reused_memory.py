"""Memory reused by the block forwards (`hf_featcal._kernels.reuse`): handed out again only once no tensor
refers to it, outputs equal bit for bit to fresh ones (Linears against `F.linear`, activations against the
modules' own forwards), and a calibration through it gives the same weights as one without it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import NewGELUActivation, QuickGELUActivation

import hf_featcal._kernels.reuse as reuse
from hf_featcal import FeatCalCalibrator
from hf_featcal._kernels.activations import lean_activations
from hf_featcal._kernels.gemm import onednn_linears
from hf_featcal._kernels.reuse import ReusableMemory, linears_into

needs_use_count = pytest.mark.skipif(not ReusableMemory.available(), reason="this torch has no storage use count")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_use_count
def test_memory_is_handed_out_again_once_nobody_holds_it():
    memory, like = ReusableMemory(), torch.zeros(1)
    first = memory.empty((4, 6), like)
    pointer = first.data_ptr()
    del first
    again = memory.empty((4, 6), like)
    assert again.data_ptr() == pointer
    smaller = memory.empty((3, 5), like)  # held `again` keeps its block: a new one
    smaller_pointer = smaller.data_ptr()
    assert smaller_pointer != pointer
    del again, smaller
    assert memory.empty((3, 4), like).data_ptr() == smaller_pointer  # the smaller of the two free blocks
    assert len(memory._kept) == 2


@needs_use_count
def test_a_block_over_twice_the_size_asked_for_is_not_handed_out():
    memory, like = ReusableMemory(), torch.zeros(1)
    big = memory.empty((100,), like)
    pointer = big.data_ptr()
    del big
    small = memory.empty((49,), like)  # 100 > 2 × 49: a block of its own
    assert small.data_ptr() != pointer and len(memory._kept) == 2
    assert memory.empty((50,), like).data_ptr() == pointer


@needs_use_count
@pytest.mark.parametrize("hold", ["tensor", "view", "detached", "reshaped", "slice", "in_a_list"])
def test_memory_somebody_refers_to_is_never_handed_out(hold):
    memory, like = ReusableMemory(), torch.zeros(1)
    out = memory.empty((8, 4), like).fill_(7.0)
    held = {
        "tensor": lambda t: t,
        "view": lambda t: t.view(32),
        "detached": lambda t: t.detach(),
        "reshaped": lambda t: t.reshape(4, 8),
        "slice": lambda t: t[2:3],
        "in_a_list": lambda t: [t.T],
    }[hold](out)
    del out
    for _ in range(3):  # further tensors of that size come from other memory
        memory.empty((8, 4), like).fill_(-1.0)
    kept = held[0] if isinstance(held, list) else held
    assert bool((kept == 7.0).all())


@needs_use_count
def test_the_smallest_free_block_that_fits_is_chosen_and_dtypes_are_kept_apart():
    memory = ReusableMemory()
    big, small = memory.empty((100,), torch.zeros(1)), memory.empty((10,), torch.zeros(1))
    big_pointer, small_pointer = big.data_ptr(), small.data_ptr()
    del big, small
    assert memory.empty((5,), torch.zeros(1)).data_ptr() == small_pointer
    assert memory.empty((50,), torch.zeros(1)).data_ptr() == big_pointer
    doubles = memory.empty((5,), torch.zeros(1, dtype=torch.float64))
    assert doubles.dtype == torch.float64 and doubles.data_ptr() not in (big_pointer, small_pointer)


@needs_use_count
def test_what_is_kept_stays_within_its_limits_and_let_go_tensors_stay_valid():
    memory, like = ReusableMemory(max_kept=3, max_bytes=1 << 20), torch.zeros(1)
    held = [memory.empty((1000,), like).fill_(float(i)) for i in range(5)]  # all held: 5 blocks made
    assert len(memory._kept) == 3
    for i, tensor in enumerate(held):
        assert bool((tensor == float(i)).all())
    large = memory.empty((300_000,), like)  # 1.2 MB alone is over max_bytes: the others are let go
    assert len(memory._kept) == 1 and memory.kept_bytes == large.numel() * 4
    memory.clear()
    assert memory.kept_bytes == 0 and bool((held[0] == 0.0).all())


def test_without_the_use_count_every_tensor_is_new(monkeypatch):
    monkeypatch.setattr(reuse, "_storage_use_count", None)
    memory = ReusableMemory()
    assert not memory.available()
    assert memory.empty((4, 4), torch.zeros(1)).shape == (4, 4) and memory._kept == []
    linear = torch.nn.Linear(2, 2)
    with linears_into(linear, memory):
        assert "forward" not in linear.__dict__


def test_off_the_cpu_every_tensor_is_new():
    memory = ReusableMemory()
    out = memory.empty((3, 2), torch.zeros(1, device="meta"))
    assert out.device.type == "meta" and memory._kept == []


@needs_use_count
@pytest.mark.parametrize("shape", [(7, 12), (3, 5, 12), (2, 3, 4, 12), (1, 12), (800, 12)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_linears_write_into_reused_memory_what_f_linear_gives(shape, bias):
    linear = torch.nn.Linear(12, 20, bias=bias)
    memory = ReusableMemory()
    inputs = [torch.randn(*shape, generator=_gen(i)) for i in range(3)]
    expected = [F.linear(x, linear.weight, linear.bias) for x in inputs]
    with torch.no_grad(), linears_into(linear, memory):
        assert "forward" in linear.__dict__
        first = linear(inputs[0])  # held while the next ones are computed
        rest = [linear(x) for x in inputs[1:]]
        again = linear(inputs[0])
    assert "forward" not in linear.__dict__
    assert torch.equal(first, expected[0]) and torch.equal(again, expected[0])
    for got, want in zip(rest, expected[1:], strict=True):
        assert torch.equal(got, want)
    assert first.data_ptr() != again.data_ptr()  # `first` was held: its memory was not reused
    del first, rest
    with torch.no_grad(), linears_into(linear, memory):
        assert linear(inputs[1]).data_ptr() in {b.data_ptr() for b, _ in memory._kept}


@needs_use_count
def test_linears_run_their_own_forward_where_the_kernel_does_not_apply():
    linear = torch.nn.Linear(6, 4)
    doubled = copy.deepcopy(linear).double()
    memory = ReusableMemory()
    x = torch.randn(5, 6, generator=_gen(5), requires_grad=True)
    F.linear(x, linear.weight, linear.bias).square().sum().backward()
    expected_grad, x.grad = x.grad.clone(), None
    with linears_into(linear, memory):
        linear(x).square().sum().backward()  # gradients on: its own forward, which torch differentiates
        assert torch.equal(x.grad, expected_grad)
        with torch.no_grad():
            strided = torch.randn(6, 5, generator=_gen(6)).T  # not contiguous
            assert torch.equal(linear(strided), F.linear(strided, linear.weight, linear.bias))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert linear(x.detach()).dtype == torch.bfloat16
            with linears_into(doubled, memory):
                wide = x.detach().double()
                assert torch.equal(doubled(wide), F.linear(wide, doubled.weight, doubled.bias))
            assert memory._kept == []  # none of these took memory
            linear(x.detach())  # a plain float32 contiguous product does
    assert len(memory._kept) == 1


def test_linears_already_replaced_and_subclasses_are_left_alone_and_forwards_come_back_on_error():
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    plain, replaced, subclass = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), Doubled(3, 3)

    def own(x):
        return x

    replaced.forward = own
    root = torch.nn.Sequential(plain, replaced, subclass)
    with pytest.raises(RuntimeError, match="body failed"), linears_into(root, ReusableMemory()):
        assert ("forward" in plain.__dict__) == ReusableMemory.available()
        assert replaced.forward is own and "forward" not in subclass.__dict__
        raise RuntimeError("body failed")
    assert "forward" not in plain.__dict__ and replaced.forward is own


@needs_use_count
def test_under_onednn_the_linears_keep_onednn_and_only_the_rest_reuse_memory(monkeypatch):
    from hf_featcal._kernels import gemm

    if not gemm.onednn_available():
        pytest.skip("no working oneDNN inner product in this torch")
    monkeypatch.setenv(gemm.GEMM_LIBRARY_VARIABLE, "onednn")
    linear = torch.nn.Linear(8, 8)
    with onednn_linears(linear), linears_into(linear, ReusableMemory()):
        assert linear.forward.__qualname__.startswith("_onednn_forward")


@needs_use_count
@pytest.mark.parametrize("cls", [QuickGELUActivation, NewGELUActivation], ids=lambda c: c.__name__)
def test_lean_activations_in_reused_memory_equal_their_own_forward_and_held_outputs_stay(cls):
    module, memory = cls(), ReusableMemory()
    inputs = [torch.randn(6, 40, generator=_gen(10 + i)) * 3 for i in range(3)]
    expected = [module(x) for x in inputs]
    with torch.no_grad(), lean_activations(module, memory):
        held = module(inputs[0])
        rest = [module(x) for x in inputs[1:]]
    assert torch.equal(held, expected[0])
    for got, want in zip(rest, expected[1:], strict=True):
        assert torch.equal(got, want)
    assert memory._kept  # the new tensors came from the reused memory


@needs_use_count
def test_a_calibration_reuses_memory_and_its_weights_and_report_do_not_change(clip_setting, monkeypatch):
    base, experts, merged, data = clip_setting
    handed = {"new": 0, "again": 0}
    empty = ReusableMemory.empty

    def counting(self, shape, like):
        before = len(self._kept)
        out = empty(self, shape, like)
        handed["again" if len(self._kept) == before else "new"] += 1
        return out

    def calibrated():
        model = copy.deepcopy(merged)
        calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
        calibrator.calibrate()
        assert calibrator.context._memory is None  # the kept memory is let go with the run
        return model.state_dict(), calibrator.report.to_dict()

    monkeypatch.setattr(ReusableMemory, "empty", counting)
    reused, reused_report = calibrated()
    assert handed["again"] > 4 * handed["new"] > 0  # most outputs went into memory used before
    monkeypatch.setattr(reuse, "_storage_use_count", None)
    fresh, fresh_report = calibrated()
    for name, value in fresh.items():
        assert torch.equal(reused[name], value), name
    assert reused_report == fresh_report
