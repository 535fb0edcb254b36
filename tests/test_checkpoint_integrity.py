"""A checkpoint is trusted only as committed: every block file is verified against the SHA-256 that
`state.json` recorded at its commit, the streams against the SHA-256 in their file, resumed values
are checked finite before they are written, and a `checkpoint_dir` that cannot take a file (a full
disk) is named in the error while the model is left as it was."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_featcal import FeatCalCalibrator
from hf_featcal.checkpointing import STATE_NAME
from test_failsafe import _assert_bit_identical, _assert_same_result, _interrupted_checkpoint, _model_state


def _calibrator(model, setting, folder) -> FeatCalCalibrator:
    base, experts, _, data = setting
    return FeatCalCalibrator(model, base, experts, data, show_progress=False, checkpoint_dir=folder)


def _finished_checkpoint(setting, folder):
    """A checkpoint of the whole run (both blocks committed) and the calibrated model."""
    model = copy.deepcopy(setting[2])
    calibrator = _calibrator(model, setting, folder)
    calibrator.calibrate()
    return model, calibrator


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _flip_last_bit(path) -> None:
    """Bit rot: one bit of the file's last byte (tensor data, not the header) flipped; names and shapes stay."""
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))


def _writes_recorded(calibrator, monkeypatch) -> list[str]:
    written = []
    original = calibrator.parameters.write
    monkeypatch.setattr(
        calibrator.parameters, "write", lambda name, value: written.append(name) or original(name, value)
    )
    return written


def test_state_records_the_sha256_of_every_block_file(clip_setting, tmp_path):
    folder = tmp_path / "ckpt"
    _finished_checkpoint(clip_setting, folder)
    state = json.load(open(folder / STATE_NAME))
    assert state["finished_blocks"] == 2
    assert state["block_sha256"] == {name: _sha256(folder / name) for name in ("block-00001.safetensors",
                                                                               "block-00002.safetensors")}


def test_a_block_file_changed_since_its_commit_is_refused_before_anything_is_written(clip_setting, tmp_path,
                                                                                     monkeypatch):
    folder = tmp_path / "ckpt"
    _finished_checkpoint(clip_setting, folder)
    block = folder / "block-00002.safetensors"
    shapes = {k: v.shape for k, v in load_file(str(block)).items()}
    _flip_last_bit(block)
    assert {k: v.shape for k, v in load_file(str(block)).items()} == shapes  # names and shapes as committed

    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _calibrator(model, clip_setting, folder)
    written = _writes_recorded(calibrator, monkeypatch)
    with pytest.raises(ValueError) as refused:
        calibrator.calibrate()
    assert str(refused.value).startswith(
        f"`checkpoint_dir` {str(folder)!r} is damaged (block-00002.safetensors: its contents are not those committed "
        f"with block 2 (SHA-256 {_sha256(block)}, recorded "
    )
    assert written == []  # block 1, which is intact, was not written either
    _assert_bit_identical(model, before)


def test_a_changed_streams_file_is_refused(clip_setting, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _interrupted_checkpoint(clip_setting, folder, monkeypatch)
    (streams,) = [name for name in os.listdir(folder) if name.startswith("streams-")]
    _flip_last_bit(folder / streams)
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    calibrator = _calibrator(model, clip_setting, folder)
    written = _writes_recorded(calibrator, monkeypatch)
    with pytest.raises(ValueError, match=rf"is damaged \({streams}: ValueError: its contents are not those committed"):
        calibrator.calibrate()
    assert written == []
    _assert_bit_identical(model, before)


def test_non_finite_values_in_a_block_file_are_never_written(clip_setting, tmp_path):
    """A block file holding NaN with a matching recorded digest (e.g. saved so by a broken writer):
    refused at its finiteness check, the model restored."""
    folder = tmp_path / "ckpt"
    _finished_checkpoint(clip_setting, folder)
    block = folder / "block-00002.safetensors"
    tensors = load_file(str(block))
    key = sorted(k for k in tensors if k.endswith("mlp.fc1.weight"))[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(block))
    state = json.load(open(folder / STATE_NAME))
    state["block_sha256"]["block-00002.safetensors"] = _sha256(block)
    json.dump(state, open(folder / STATE_NAME, "w"))

    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    with pytest.raises(ValueError, match=rf"is damaged \(block-00002.safetensors: '{key}' holds NaN or Inf values\)"):
        _calibrator(model, clip_setting, folder).calibrate()
    _assert_bit_identical(model, before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@contextlib.contextmanager
def _file_size_limit(folder, limit: int):
    """Files of this process may not grow past `limit` bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so a write
    past it fails with EFBIG, as a full disk fails with ENOSPC). Yields the call that lifts the limit."""
    resource = pytest.importorskip("resource")
    if not hasattr(signal, "SIGXFSZ"):
        pytest.skip("no SIGXFSZ on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the hard file-size limit is below the test's")
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@contextlib.contextmanager
def _small_tmpfs(folder, limit: int):
    """`folder` a tmpfs of `limit` bytes: a really full disk (needs root and mount permission, else the
    test is skipped). Yields the call that makes room (remounted larger); unmounted at the end."""
    folder.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,size=1m", str(folder)], check=True)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize(
    "full_disk, reason",
    [(_file_size_limit, "File too large, errno 27"), (_small_tmpfs, "No space left on device, errno 28")],
    ids=["file-size-limit", "tmpfs"],
)
def test_a_full_checkpoint_dir_is_named_and_the_model_restored(clip_setting, tmp_path, full_disk, reason):
    expected_model, expected = _finished_checkpoint(clip_setting, tmp_path / "expected")
    block_bytes = os.path.getsize(tmp_path / "expected" / "block-00001.safetensors")
    disk = tmp_path / "disk"
    folder = disk / "ckpt"
    model = copy.deepcopy(clip_setting[2])
    before = _model_state(model)
    with full_disk(disk, (block_bytes // 2) & ~4095 or 4096) as make_room:  # room for less than one block file
        calibrator = _calibrator(model, clip_setting, folder)
        with pytest.raises(OSError) as refused:
            calibrator.calibrate()
        assert str(refused.value) == (
            f"`checkpoint_dir` {str(folder)!r}: cannot write block-00001.safetensors ({reason}). "
            "Free space there or pass another folder; the blocks committed before stay resumable."
        )
        _assert_bit_identical(model, before)
        assert os.listdir(folder) == []  # the partial file is gone
        make_room()
        resumed = _calibrator(model, clip_setting, folder)
        resumed.calibrate()
    _assert_same_result(model, resumed, expected_model, expected)
