"""`save_model` puts the folder in place atomically: a failure part-way (full disk, interrupt) leaves the
previous folder or nothing, never a partial one; no shard or index of an earlier save survives; a folder
holding anything but an earlier model save is refused, not deleted."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import CLIPVisionModel

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.experts import safetensors_files


@pytest.fixture
def calibrator(clip_setting):
    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(num_samples_per_task=10), show_progress=False)
    calibrator.calibrate()
    return calibrator


def _snapshot(folder) -> dict[str, str]:
    """File name → content hash of every file in `folder`."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}


def _leftovers(parent) -> list[str]:
    return sorted(name for name in os.listdir(parent) if name.startswith("."))


def _full_disk(monkeypatch, error: BaseException):
    """Make transformers' weight writer write part of the file, then fail as a full disk does."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_save_file

    def failing(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 128)
        raise error

    monkeypatch.setattr(modeling_utils, "safe_save_file", failing)
    return real


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["full-disk", "interrupt"])
def test_a_failed_save_leaves_the_previous_folder(calibrator, tmp_path, monkeypatch, error):
    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    before = _snapshot(out)
    with torch.no_grad():
        for p in calibrator.model.parameters():
            p.add_(1.0)  # a different model: a partial overwrite would show in the hashes
    _full_disk(monkeypatch, error)
    with pytest.raises(type(error)):
        calibrator.save_model(out)
    assert _snapshot(out) == before
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    calibrator.save_model(out)  # and the next save goes through
    assert _snapshot(out)["model.safetensors"] != before["model.safetensors"]
    assert _leftovers(tmp_path) == []


def test_a_failed_first_save_leaves_nothing(calibrator, tmp_path, monkeypatch):
    out = tmp_path / "new" / "calibrated"
    _full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        calibrator.save_model(out)
    assert not out.exists()
    assert _leftovers(tmp_path / "new") == []


def test_a_failure_after_the_weights_leaves_no_config_only_folder(calibrator, tmp_path, monkeypatch):
    """The last file (the card) fails: the folder is not left with weights but no card, or a config alone."""
    out = tmp_path / "calibrated"

    def failing_save(self, filepath):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ModelCard, "save", failing_save)
    with pytest.raises(OSError):
        calibrator.save_model(out)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_sharded_then_unsharded_save_leaves_no_index_or_shards(calibrator, tmp_path):
    out = tmp_path / "calibrated"
    calibrator.model.save_pretrained(out, max_shard_size="20KB")
    (out / "featcal_evaluation.json").write_text("{}")  # an output of an earlier run, stale now
    assert "model.safetensors.index.json" in os.listdir(out)
    calibrator.save_model(out)
    files = sorted(os.listdir(out))
    assert not [f for f in files if f.endswith(".index.json") or f.startswith("model-")], files
    assert "featcal_evaluation.json" not in files and "model.safetensors" in files
    # both readers see the new single file: transformers and hf_featcal's lazy reader
    assert set(safetensors_files(str(out)).values()) == {str(out / "model.safetensors")}
    reloaded = CLIPVisionModel.from_pretrained(out)
    for name, value in calibrator.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def test_other_content_of_the_folder_is_kept(calibrator, tmp_path):
    """Files that are not part of a model save (yours, another process's) stay; the earlier save's go."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (out / "tokenizer.json").write_text("{}")  # an earlier save's tokenizer: this save has none
    calibrator.save_model(out)
    files = sorted(os.listdir(out))
    assert {"notes.txt", "runs", "model.safetensors", "config.json"} <= set(files)
    assert "model-00001-of-00002.safetensors" not in files and "tokenizer.json" not in files
    assert (out / "notes.txt").read_text() == "mine" and _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match=r"`output_dir` .* is a file"):
        calibrator.save_model(out / "notes.txt")


def test_a_failure_while_swapping_files_in_restores_the_folder(calibrator, tmp_path, monkeypatch):
    """A rename failing half-way through the swap into an existing folder: everything is renamed back."""
    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with torch.no_grad():
        for p in calibrator.model.parameters():
            p.mul_(2.0)
    real_rename, calls = os.rename, []

    def flaky_rename(source, destination):
        calls.append(destination)
        into_target = os.path.dirname(os.fspath(destination)) == str(out)
        if into_target and sum(os.path.dirname(os.fspath(d)) == str(out) for d in calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", flaky_rename)
    with pytest.raises(OSError, match="Input/output"):
        calibrator.save_model(out)
    monkeypatch.undo()
    assert _snapshot(out) == before
    assert _leftovers(tmp_path) == []


def test_an_empty_existing_folder_is_filled(calibrator, tmp_path):
    out = tmp_path / "made-by-the-user"
    out.mkdir()
    calibrator.save_model(out)
    assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(out))
    assert _leftovers(tmp_path) == []


def test_push_to_hub_deletes_stale_remote_weights(calibrator, monkeypatch):
    """The hub cannot be reached here: what huggingface_hub's upload receives. Remote weight files the
    upload does not rewrite (e.g. shards of an earlier push) are deleted in the same commit."""
    from huggingface_hub import HfApi

    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: None)

    def upload_folder(self, *, repo_id, folder_path, commit_message, **kwargs):
        calls.update(files=sorted(os.listdir(folder_path)), **kwargs)

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    calibrator.push_to_hub("me/model")
    assert "model.safetensors" in calls["files"]
    # which remote files these patterns delete, as huggingface_hub selects them
    from huggingface_hub.utils import filter_repo_objects

    remote = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
              "model.safetensors", "README.md", "onnx/model.onnx", "notes.txt"]
    deleted = [path for path in filter_repo_objects(remote, allow_patterns=calls["delete_patterns"])
               if path not in calls["files"]]
    assert deleted == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
