"""A restore under a second fault still gives back the model exactly as it was: the disk snapshot
survives a temp-folder cleaner deleting its files during the run, and a second Ctrl-C (a real
SIGINT) during the restore, or during a save's rollback, waits until it is done, then reaches the
caller as KeyboardInterrupt."""

from __future__ import annotations

import copy
import errno
import os
import shutil
import signal

import pytest
import torch

import hf_featcal.pipeline.solve as solve_stage
import hf_featcal.restore as restore
from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.interrupts import interrupts_deferred
from test_failsafe import _assert_bit_identical, _Fault, _model_state
from test_save_folder import _leftovers, _snapshot


def _failing_calibrator(model, setting, snapshot: str, monkeypatch, error: type[BaseException]) -> FeatCalCalibrator:
    """A calibrator whose run fails with `error` in block 2 (of 2), after block 1 was written."""
    base, experts, _, data = setting
    calibrator = FeatCalCalibrator(model, base, experts, data, FeatCalConfig(restore_snapshot=snapshot),
                                   show_progress=False)
    _Fault(6, error).wrap(monkeypatch, solve_stage, "solve_linear_weights")  # 6th of 8 linear solves
    return calibrator


def test_the_disk_snapshot_survives_a_cleaner_deleting_it_during_the_run(clip_setting, snapshot_tmpdir, monkeypatch):
    monkeypatch.setattr(restore, "SNAPSHOT_FILE_BYTES", 4096)  # several files
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _failing_calibrator(model, clip_setting, "disk", monkeypatch, RuntimeError)
    removed = []
    original = calibrator.layer_map.run_block

    def run_block_after_a_cleaner(*args, **kwargs):  # what tmpreaper / systemd-tmpfiles do to an old folder
        for name in os.listdir(snapshot_tmpdir):
            removed.extend(os.listdir(snapshot_tmpdir / name))
            shutil.rmtree(snapshot_tmpdir / name)
        return original(*args, **kwargs)

    monkeypatch.setattr(calibrator.layer_map, "run_block", run_block_after_a_cleaner)
    with pytest.raises(RuntimeError, match="fault injected"):  # the real error, not a missing file's
        calibrator.calibrate()
    assert len(removed) > 1  # the snapshot's files existed, and were gone long before the restore
    _assert_bit_identical(model, before)
    assert os.listdir(snapshot_tmpdir) == []


@pytest.mark.parametrize("snapshot", ["memory", "disk"])
def test_a_second_ctrl_c_during_the_restore_waits_until_the_model_is_back(clip_setting, snapshot_tmpdir, monkeypatch,
                                                                          snapshot):
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _failing_calibrator(model, clip_setting, snapshot, monkeypatch, KeyboardInterrupt)
    store = restore._DiskSnapshot if snapshot == "disk" else restore._MemorySnapshot
    original_read, reads = store.read, []

    def read_then_ctrl_c(self, key):
        reads.append(key)
        if len(reads) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a real second Ctrl-C, part-way through the restore
        return original_read(self, key)

    monkeypatch.setattr(store, "read", read_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        calibrator.calibrate()
    assert len(reads) > 2
    assert "fault injected" not in str(interrupted.value)  # the second interrupt, raised after the restore...
    assert "fault injected" in str(interrupted.value.__context__)  # ...with the first one chained
    _assert_bit_identical(model, before)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.fixture
def calibrated(clip_setting):
    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(num_samples_per_task=10),
                                   show_progress=False)
    calibrator.calibrate()
    return calibrator


def test_a_second_ctrl_c_during_a_saves_rollback_waits_until_the_folder_is_back(calibrated, tmp_path, monkeypatch):
    out = tmp_path / "calibrated"
    calibrated.save_model(out)
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with torch.no_grad():
        for p in calibrated.model.parameters():
            p.mul_(2.0)
    real_rename, into_target, rollback = os.rename, [], []

    def rename_failing_then_interrupted(source, destination):
        if len(into_target) == 3:  # rolling back
            rollback.append(destination)
            if len(rollback) == 1:
                os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C at the rollback's first rename
        elif os.path.dirname(os.fspath(destination)) == str(out):
            into_target.append(destination)
            if len(into_target) == 3:
                raise OSError(errno.EIO, "Input/output error")  # the first fault, part-way through the swap
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename_failing_then_interrupted)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        calibrated.save_model(out)
    monkeypatch.undo()
    assert isinstance(interrupted.value.__context__, OSError)
    assert len(rollback) > 1  # the rollback went on after the Ctrl-C
    assert _snapshot(out) == before
    assert _leftovers(tmp_path) == []


def test_interrupts_deferred_calls_the_previous_handler_once_after_the_body():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(("handler", signum)))
    try:
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            seen.append("body done")
        assert seen == ["body done", ("handler", signal.SIGINT)]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_deferred():  # an ignored SIGINT stays ignored
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
