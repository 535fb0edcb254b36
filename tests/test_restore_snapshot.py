"""`FeatCalConfig.restore_snapshot='disk'`: the copy kept to restore the model on failure lives in
safetensors files of a temporary folder under TMPDIR, which exists only while `calibrate()` runs;
a failure still leaves the model bit-identical, and results equal those with the in-memory copy."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors import safe_open
from torch import nn

import hf_featcal.pipeline.solve as solve_stage
import hf_featcal.restore as restore
from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalError
from hf_featcal.parameters import ModelParameters
from hf_featcal.restore import restore_on_failure
from test_failsafe import _assert_bit_identical, _assert_same_result, _Fault, _model_state, damage_outside_the_blocks
from test_offload import _dispatched, base_failing_in_block_2


class _FolderWatch:
    """Wraps a function of the run; at each call records the snapshot folders under `root` and the
    keys of their files."""

    def __init__(self, root) -> None:
        self.root, self.folders, self.keys, self.files = root, set(), set(), 0

    def wrap(self, monkeypatch, owner, attr: str) -> None:
        original = getattr(owner, attr)

        def watched(*args, **kwargs):
            for name in os.listdir(self.root):
                self.folders.add(name)
                files = os.listdir(self.root / name)
                self.files = max(self.files, len(files))
                for file in files:
                    with safe_open(str(self.root / name / file), framework="pt") as handle:
                        self.keys.update(handle.keys())
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, watched)


def _calibrator(model, setting, snapshot: str) -> FeatCalCalibrator:
    base, experts, _, data = setting
    return FeatCalCalibrator(model, base, experts, data, FeatCalConfig(restore_snapshot=snapshot), show_progress=False)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failure_mid_run_with_the_disk_snapshot_restores_the_model_and_removes_the_folder(
    clip_setting, snapshot_tmpdir, monkeypatch, error
):
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _calibrator(model, clip_setting, "disk")
    watch = _FolderWatch(snapshot_tmpdir)
    watch.wrap(monkeypatch, calibrator.layer_map, "run_block")
    written_before_the_fault = []
    original_solve = solve_stage.solve_linear_weights

    def solve_noting_writes(*args, **kwargs):  # was the model already changed when the fault hit?
        fc1 = model.encoder.layers[0].mlp.fc1.weight
        written_before_the_fault.append(not torch.equal(fc1, before["encoder.layers.0.mlp.fc1.weight"][0]))
        return original_solve(*args, **kwargs)

    monkeypatch.setattr(solve_stage, "solve_linear_weights", solve_noting_writes)
    fault = _Fault(None, error)
    fault.wrap(monkeypatch, solve_stage, "solve_linear_weights")
    fault.at = 6  # of 8 linear solves (4 groups per block, 2 blocks): inside block 2, block 1 written
    with pytest.raises(error, match="fault injected"):
        calibrator.calibrate()
    assert written_before_the_fault[-1], "the fault hit before any block was written: nothing to restore"
    _assert_bit_identical(model, before)
    assert len(watch.folders) == 1 and next(iter(watch.folders)).startswith("hf_featcal-restore-")
    assert len(watch.keys) == len(before)  # one copy of every parameter and buffer, in the files
    assert os.listdir(snapshot_tmpdir) == []  # the folder is removed after the failure


def test_a_successful_run_removes_the_folder_and_equals_the_memory_snapshot_bit_for_bit(clip_setting, snapshot_tmpdir,
                                                                                        monkeypatch):
    expected_model = copy.deepcopy(clip_setting[2])
    expected = _calibrator(expected_model, clip_setting, "memory")
    watch_memory = _FolderWatch(snapshot_tmpdir)
    with pytest.MonkeyPatch.context() as patch:
        watch_memory.wrap(patch, expected.layer_map, "run_block")
        expected.calibrate()
    assert watch_memory.folders == set()  # the memory snapshot writes nothing

    model = copy.deepcopy(clip_setting[2])
    calibrator = _calibrator(model, clip_setting, "disk")
    watch = _FolderWatch(snapshot_tmpdir)
    watch.wrap(monkeypatch, calibrator.layer_map, "run_block")
    calibrator.calibrate()
    assert len(watch.folders) == 1 and watch.files >= 1
    assert os.listdir(snapshot_tmpdir) == []
    _assert_same_result(model, calibrator, expected_model, expected)
    assert not torch.equal(model.encoder.layers[0].mlp.fc1.weight, clip_setting[2].encoder.layers[0].mlp.fc1.weight)
    assert [e["objective_decrease"] for e in calibrator.solve_log] == [
        e["objective_decrease"] for e in expected.solve_log
    ]


def test_a_late_failure_after_a_dtype_change_restores_from_disk_in_small_files(clip_setting, snapshot_tmpdir,
                                                                               monkeypatch):
    """One file per tensor (a 1-byte file size): the snapshot spans many files; the body casts the model to half
    and zeroes tensors outside the blocks, so restoring replaces tensor data from the files."""
    monkeypatch.setattr(restore, "SNAPSHOT_FILE_BYTES", 1)
    base, experts, merged, data = clip_setting
    model = copy.deepcopy(merged)
    before = _model_state(model)
    calibrator = _calibrator(model, clip_setting, "disk")
    original = calibrator._sweep
    files = []

    def sweep_then_fail():
        original()
        (folder,) = os.listdir(snapshot_tmpdir)
        files.append(len(os.listdir(snapshot_tmpdir / folder)))
        damage_outside_the_blocks(model)
        raise RuntimeError("late failure")

    monkeypatch.setattr(calibrator, "_sweep", sweep_then_fail)
    with pytest.raises(RuntimeError, match="late failure"):
        calibrator.calibrate()
    _assert_bit_identical(model, before)
    assert files == [len(before)]
    assert os.listdir(snapshot_tmpdir) == []


class _Tied(nn.Module):
    """Tied weights, a buffer overlapping another's memory, a transposed (non-contiguous)
    parameter, an integer buffer and a complex buffer (a dtype kept in memory)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
        self.b.weight = self.a.weight
        self.register_buffer("table", torch.randn(5, 4, generator=gen))
        self.register_buffer("rows", self.table[1:4])  # a view into `table`'s memory
        self.t = nn.Parameter(torch.randn(4, 6, generator=gen).t())
        self.register_buffer("steps", torch.arange(7))
        self.register_buffer("phase", torch.randn(3, generator=gen, dtype=torch.float64) * 1j)  # complex128


def test_restore_handles_tied_overlapping_non_contiguous_and_complex_tensors(snapshot_tmpdir):
    model = _Tied()
    before = _model_state(model)
    values = {name: t.detach().clone() for name, t in model.state_dict(keep_vars=True).items()}
    with pytest.raises(ValueError, match="body failed"):
        with restore_on_failure(model, [name for name, _ in model.named_parameters()], snapshot="disk"):
            assert len(os.listdir(snapshot_tmpdir)) == 1
            with torch.no_grad():
                model.a.weight.mul_(-2.0)
                model.table.zero_()
                model.t.add_(1.0)
                model.steps.fill_(-1)
                model.phase.mul_(2.0)
            model.double()
            raise ValueError("body failed")
    _assert_bit_identical(model, before)
    assert model.b.weight is model.a.weight  # still tied
    for name, value in values.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert os.listdir(snapshot_tmpdir) == []


def test_an_unknown_snapshot_place_is_refused(snapshot_tmpdir):
    with pytest.raises(ValueError, match=r"`snapshot` must be one of \('memory', 'disk'\), got 'ssd'"):
        with restore_on_failure(_Tied(), [], snapshot="ssd"):
            pass
    assert os.listdir(snapshot_tmpdir) == []


def test_a_failure_restores_offloaded_weights_from_the_disk_snapshot(clip_setting, tmp_path, snapshot_tmpdir,
                                                                     monkeypatch):
    base, experts, merged, data = clip_setting
    model = _dispatched(merged, "disk", tmp_path)
    params = ModelParameters(model)
    state = {name: params.read(name).clone() for name, _ in model.named_parameters()}
    broken = base_failing_in_block_2(base)
    calibrator = FeatCalCalibrator(model, broken, experts, data, FeatCalConfig(restore_snapshot="disk"),
                                   show_progress=False)
    watch = _FolderWatch(snapshot_tmpdir)
    watch.wrap(monkeypatch, calibrator.layer_map, "run_block")
    with pytest.raises(FeatCalError):
        calibrator.calibrate()
    assert "offloaded.encoder.layers.0.mlp.fc1.weight" in watch.keys  # offloaded values went to the files
    for name, value in state.items():
        assert torch.equal(params.read(name), value), name
    assert os.listdir(snapshot_tmpdir) == []


def test_a_snapshot_that_cannot_be_written_fails_before_any_work_and_leaves_nothing(clip_setting, snapshot_tmpdir,
                                                                                    monkeypatch):
    import errno

    import safetensors.torch

    def disk_full(tensors, filename, metadata=None):
        open(filename, "wb").close()  # a partial file, as a full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _calibrator(model, clip_setting, "disk")
    blocks = []
    monkeypatch.setattr(calibrator, "_calibrate_block", lambda *a: blocks.append(a))
    with pytest.raises(OSError,
                       match=r"restore_snapshot='disk': cannot write the restore snapshot in .*No space left.*TMPDIR"):
        calibrator.calibrate()
    assert blocks == []  # refused before the first block
    _assert_bit_identical(model, before)
    assert os.listdir(snapshot_tmpdir) == []


# ======================================================= the memory snapshot keeps the original memory
class _Handover(nn.Module):
    """A plain Linear, a tied copy of it, a parameter whose memory a buffer views, and a parameter
    that is not among those written."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
        self.b.weight = self.a.weight
        self.p = nn.Parameter(torch.randn(5, 2, generator=gen))
        self.register_buffer("p_rows", self.p.data[1:3])  # a view into p's memory
        self.q = nn.Parameter(torch.randn(3, generator=gen))


_WRITTEN = ["a.weight", "a.bias", "p"]


def _write_everything(model: _Handover) -> None:
    with torch.no_grad():
        model.a.weight.mul_(-2.0)
        model.a.bias.add_(1.0)
        model.p.add_(10.0)
        model.q.add_(10.0)


def test_the_memory_snapshot_keeps_the_original_memory_and_the_run_writes_a_private_copy():
    model = _Handover()
    original = {name: t.detach() for name, t in model.named_parameters()}  # aliases of the memory as it was
    values = {name: t.clone() for name, t in original.items()}
    pointers = {name: t.data_ptr() for name, t in original.items()}
    with restore_on_failure(model, _WRITTEN):
        assert model.a.weight.data_ptr() != pointers["a.weight"]  # a private copy...
        assert torch.equal(model.a.weight, values["a.weight"])  # ...of the same values
        assert model.p.data_ptr() == pointers["p"]  # its memory is shared with a buffer: kept in place
        assert model.q.data_ptr() == pointers["q"]  # not written: copied into the snapshot as before
        _write_everything(model)
    assert torch.equal(original["a.weight"], values["a.weight"])  # the original memory was never written
    assert torch.equal(original["a.bias"], values["a.bias"])
    assert torch.equal(model.a.weight, -2.0 * values["a.weight"])  # the run's writes stay
    assert model.b.weight is model.a.weight  # still tied
    assert torch.equal(model.p_rows, model.p[1:3])  # the view still sees p's values
    assert torch.equal(model.p, values["p"] + 10.0)


def test_a_failure_hands_the_original_memory_back(snapshot_tmpdir):
    model = _Handover()
    before = _model_state(model)
    pointers = {name: t.data_ptr() for name, t in model.named_parameters()}
    with pytest.raises(ValueError, match="body failed"):
        with restore_on_failure(model, _WRITTEN):
            _write_everything(model)
            model.double()
            raise ValueError("body failed")
    _assert_bit_identical(model, before)
    for name in ("a.weight", "a.bias"):  # the parameters that went on in a private copy
        assert model.get_parameter(name).data_ptr() == pointers[name], name
    assert model.b.weight is model.a.weight
    assert torch.equal(model.p_rows, model.p[1:3])


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(path):
                start, stop = line.split()[0].split("-")
                ranges.append((int(start, 16), int(stop, 16)))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_calibrating_a_memory_mapped_checkpoint_writes_outside_the_files_pages(clip_setting, tmp_path):
    """from_pretrained maps the safetensors file; the calibrated weights must not be written into its
    pages (a copy-on-write fault per page the forwards have read)."""
    from transformers import CLIPVisionModel

    base, experts, merged, data = clip_setting
    merged.save_pretrained(tmp_path / "merged")
    model = CLIPVisionModel.from_pretrained(tmp_path / "merged").eval()
    path = str(tmp_path / "merged" / "model.safetensors")

    def in_file(tensor: torch.Tensor) -> bool:
        return any(start <= tensor.data_ptr() < stop for start, stop in _mapped_ranges(path))

    written = [p for name, p in model.named_parameters() if "encoder.layers." in name]
    if not all(in_file(p) for p in written):
        pytest.skip("this transformers does not map the checkpoint's tensors")
    FeatCalCalibrator(model, base, experts, data, show_progress=False).calibrate()
    assert not any(in_file(p) for p in written)
    expected = copy.deepcopy(merged)
    FeatCalCalibrator(expected, base, experts, data, show_progress=False).calibrate()
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
