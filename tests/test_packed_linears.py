"""Linears with their weight packed for MKL (`hf_featcal.packed_linears`) give the plain product bit
for bit: a packed product is kept for a row count only where it matched the plain one on a real
batch, stale packs are never used, every other case runs the plain product, forwards are put back on
exit, and a whole calibration's weights do not change."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_featcal.packed_linears as packed_module
from conftest import build_clip_setting
from hf_featcal import FeatCalCalibrator
from hf_featcal.packed_linears import TRY_AT_CALL, PackingLinear, WeightPacks, packed_linears, runs_linear_forward

needs_mkl = pytest.mark.skipif(not packed_module.available(), reason="this torch has no MKL packed linear kernels")


def _linear(inputs: int, outputs: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inputs, outputs, bias=bias).eval()


def _batches(rows: int, inputs: int, count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, inputs, generator=gen) for _ in range(count)]


def _packed_matches_plain(module: nn.Linear, x: torch.Tensor) -> bool:
    """This machine's answer to the question the forward asks: does MKL's packed product of this
    shape reproduce the plain one exactly?"""
    rows = x.numel() // x.shape[-1]
    packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight, rows)
    return torch.equal(torch.ops.mkl._mkl_linear(x, packed, module.weight, module.bias, rows), F.linear(x, module.weight, module.bias))


# CLIP B/32's widths at 800 rows (16 images), a small layer, and a wide one where MKL's packed and
# plain products sum in another order on AVX-512 machines (the pack must then be refused)
SHAPES = [(768, 3072, 800), (3072, 768, 800), (768, 768, 800), (24, 40, 30), (1024, 1024, 800)]


@needs_mkl
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("inputs,outputs,rows", SHAPES, ids=lambda v: str(v))
def test_every_batch_equals_the_plain_product_and_packs_only_what_matched(inputs, outputs, rows, bias):
    module = _linear(inputs, outputs, bias)
    batches = _batches(rows, inputs, TRY_AT_CALL + 3)
    with torch.no_grad():
        expected = [F.linear(x, module.weight, module.bias) for x in batches]
        with packed_linears(module):
            assert type(module) is PackingLinear
            forward = packed_module._PACKS[module]
            got = [module(x) for x in batches]
            decision = forward.packed.get(rows, "untried")
        matches = _packed_matches_plain(module, batches[0])
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert (decision is not None) == matches  # packed exactly where MKL's packed product is the plain one
    assert decision != "untried"
    assert type(module) is nn.Linear and module not in packed_module._PACKS


@needs_mkl
def test_three_dimensional_inputs_are_packed_by_their_row_count():
    module = _linear(768, 768)
    batches = [x.reshape(16, 50, 768) for x in _batches(800, 768, TRY_AT_CALL + 2)]
    with torch.no_grad(), packed_linears(module):
        got = [module(x) for x in batches]
        forward = packed_module._PACKS[module]
        assert list(forward.packed) == [800]
    for g, x in zip(got, batches):
        assert g.shape == (16, 50, 768)
        assert torch.equal(g, F.linear(x, module.weight, module.bias))


@needs_mkl
def test_a_module_seen_twice_is_never_packed_and_row_counts_are_bounded():
    module = _linear(64, 64)
    with torch.no_grad(), packed_linears(module):
        forward = packed_module._PACKS[module]
        for x in _batches(32, 64, TRY_AT_CALL - 1):
            module(x)
        assert forward.packed == {}  # e.g. an expert block that sees two batches
        for rows in range(8, 8 + packed_module.MAX_ROW_COUNTS + 3):
            for x in _batches(rows, 64, TRY_AT_CALL):
                assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
        assert len(forward.packed) == packed_module.MAX_ROW_COUNTS


@needs_mkl
def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    module = _linear(96, 64)
    batches = _batches(40, 96, TRY_AT_CALL + 2)
    with torch.no_grad(), packed_linears(module):
        forward = packed_module._PACKS[module]
        for x in batches:
            module(x)
        old_pack = forward.packed.get(40)
        module.weight.mul_(-2.0)  # in place: the version counter moves
        for x in batches:
            assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
        assert forward.packed.get(40) is None or forward.packed.get(40) is not old_pack
        module.weight = nn.Parameter(torch.randn(64, 96))  # another tensor
        for x in batches:
            assert torch.equal(module(x), F.linear(x, module.weight, module.bias))


@needs_mkl
def test_the_plain_product_runs_with_gradients_under_autocast_and_for_other_inputs():
    module = _linear(32, 48)
    x = _batches(20, 32, 1)[0].requires_grad_()
    with packed_linears(module):
        forward = packed_module._PACKS[module]
        for _ in range(TRY_AT_CALL + 1):  # gradients on
            module(x).square().sum().backward()
        assert forward.packed == {}
        assert x.grad is not None and module.weight.grad is not None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(TRY_AT_CALL + 1):
                y = module(x.detach())
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, F.linear(x.detach(), module.weight, module.bias))
        assert forward.packed == {}
        with torch.no_grad():
            for other in (x.detach().double(), x.detach().T.contiguous().T, x.detach()[0]):
                for _ in range(TRY_AT_CALL + 1):
                    out = module(other) if other.dtype != torch.float64 else None
                if out is not None:
                    assert torch.equal(out, F.linear(other, module.weight, module.bias))
            assert forward.packed == {}
    double = _linear(8, 8).double()
    with torch.no_grad(), packed_linears(double):
        for x64 in _batches(10, 8, TRY_AT_CALL + 1):
            assert torch.equal(double(x64.double()), F.linear(x64.double(), double.weight, double.bias))
        assert packed_module._PACKS[double].packed == {}


def test_classes_are_put_back_on_exit_also_on_error_and_others_are_left_alone():
    plain, own_bound, hooked = _linear(4, 4), _linear(4, 4), _linear(4, 4)

    class Sub(nn.Linear):  # e.g. a PEFT or quantised layer: its own forward
        pass

    sub = Sub(4, 4)
    own_bound.forward = types.MethodType(nn.Linear.forward, own_bound)  # what accelerate's hook removal leaves
    bound = own_bound.forward

    def hook_forward(x):
        return x

    hooked.forward = hook_forward  # e.g. accelerate's hook
    root = nn.Sequential(plain, own_bound, hooked, sub)
    with pytest.raises(RuntimeError, match="body failed"):
        with packed_linears(root):
            if packed_module.available():
                assert type(plain) is PackingLinear and plain in packed_module._PACKS
            for other in (own_bound, hooked):  # an instance forward would shadow the packed one
                assert type(other) is nn.Linear and other not in packed_module._PACKS
            assert type(sub) is Sub
            raise RuntimeError("body failed")
    assert type(plain) is nn.Linear and plain not in packed_module._PACKS
    assert own_bound.__dict__["forward"] is bound
    assert hooked.forward is hook_forward
    assert type(sub) is Sub


def test_which_modules_run_linears_own_forward():
    plain, own_bound, foreign = _linear(3, 3), _linear(3, 3), _linear(3, 3)
    own_bound.forward = types.MethodType(nn.Linear.forward, own_bound)
    foreign.forward = types.MethodType(nn.Linear.forward, plain)  # Linear's forward, but of another module

    class Sub(nn.Linear):
        pass

    assert runs_linear_forward(plain) and runs_linear_forward(own_bound)
    assert not runs_linear_forward(foreign)
    assert not runs_linear_forward(Sub(3, 3))
    assert not runs_linear_forward(nn.Conv1d(3, 3, 1))
    with packed_linears(plain):
        assert runs_linear_forward(plain)  # the packed forward computes x Wᵀ + b of the module's own weight
    assert runs_linear_forward(PackingLinear(3, 3))  # (a copy made meanwhile)


@needs_mkl
def test_a_copy_of_a_packed_module_runs_the_plain_product_of_its_own_weights(tmp_path):
    """Expert blocks are deep copies of the merged block, which may hold packs at the time."""
    module = _linear(64, 32)
    batches = _batches(16, 64, TRY_AT_CALL + 2)
    with torch.no_grad(), packed_linears(module):
        for x in batches:
            module(x)
        copied = copy.deepcopy(module)
        assert type(copied) is PackingLinear and copied not in packed_module._PACKS
        copied.weight.mul_(3.0)  # the copy has weights of its own
        for x in batches:
            assert torch.equal(copied(x), F.linear(x, copied.weight, copied.bias))
            assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
        assert packed_module._PACKS[module].packed.get(16, "untried") != "untried"
        with packed_linears(copied):  # and it can hold packs of its own
            for x in batches:
                assert torch.equal(copied(x), F.linear(x, copied.weight, copied.bias))
            assert copied in packed_module._PACKS
        assert type(copied) is PackingLinear and copied not in packed_module._PACKS
    assert runs_linear_forward(copied)
    torch.save(copied, tmp_path / "copy.pt")  # a copy pickles (no packs, no weak references)
    loaded = torch.load(tmp_path / "copy.pt", weights_only=False)
    assert torch.equal(loaded(batches[0]), F.linear(batches[0], copied.weight, copied.bias))


@needs_mkl
def test_a_calibration_packs_the_merged_blocks_and_its_weights_do_not_change(generator, monkeypatch):
    base, experts, merged, data = build_clip_setting(generator)
    used = []
    original = WeightPacks.forward

    def spy(self, x, weight, bias):
        rows = x.numel() // x.shape[-1]
        used.append(self.packed.get(rows) is not None)
        return original(self, x, weight, bias)

    def calibrated():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, show_progress=False).calibrate()

    monkeypatch.setattr(WeightPacks, "forward", spy)
    packed = calibrated()
    assert len(used) > 0  # the packed forwards were in place
    first = next(m for m in merged.modules() if isinstance(m, nn.Linear))
    if _packed_matches_plain(first, torch.randn(25, first.in_features)):  # 5 images of 5 tokens
        assert any(used)  # and packs were made and used
    monkeypatch.setattr(packed_module, "available", lambda: False)
    used.clear()
    plain = calibrated()
    assert used == []
    changed = 0
    for (name, p), (_, q), (_, m) in zip(packed.named_parameters(), plain.named_parameters(), merged.named_parameters()):
        assert torch.equal(p, q), name
        changed += not torch.equal(p, m)
    assert changed >= 10
    for model in (packed, *experts.values()):
        assert all(type(m) is nn.Linear and m not in packed_module._PACKS for m in model.modules() if isinstance(m, nn.Linear))
