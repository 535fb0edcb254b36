"""`save_model` puts the folder in place atomically: a failure part-way (full disk, interrupt) leaves the
previous folder or nothing, never a partial one; no shard or index of an earlier save survives; a folder
holding anything but an earlier model save is refused, not deleted."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import CLIPVisionModel

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.model_io import safetensors_files
from hf_featcal.saving import atomic_folder, read_manifest
from testing_utils import hub_stand_in


@pytest.fixture
def calibrator(clip_setting):
    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(num_samples_per_task=10),
                                   show_progress=False)
    calibrator.calibrate()
    return calibrator


def _snapshot(folder) -> dict[str, str]:
    """Path relative to `folder` → content hash of every file in it (subfolders included)."""
    return {
        os.path.relpath(os.path.join(root, name), folder): hashlib.sha256(
            open(os.path.join(root, name), "rb").read()
        ).hexdigest()
        for root, _, files in os.walk(folder)
        for name in sorted(files)
    }


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
    """An earlier save of this library that was sharded: its shards and index (listed in its manifest)
    go, so loaders see only the new single file; the folder's other files stay."""
    out = tmp_path / "calibrated"
    with atomic_folder(out) as folder:  # a library save with sharded weights
        calibrator.model.save_pretrained(folder, max_shard_size="20KB")
        with open(os.path.join(folder, "featcal_evaluation.json"), "w") as handle:
            handle.write("{}")  # an output of an earlier run, stale now
    assert "model.safetensors.index.json" in read_manifest(out)
    (out / "notes.txt").write_text("mine")
    calibrator.save_model(out)
    files = sorted(os.listdir(out))
    assert not [f for f in files if f.endswith(".index.json") or f.startswith("model-")], files
    assert "featcal_evaluation.json" not in files and "model.safetensors" in files
    assert (out / "notes.txt").read_text() == "mine"
    # both readers see the new single file: transformers and hf_featcal's lazy reader
    assert set(safetensors_files(str(out)).values()) == {str(out / "model.safetensors")}
    reloaded = CLIPVisionModel.from_pretrained(out)
    for name, value in calibrator.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


#: A folder of the user's own: files whose names a model save also uses (README.md, config.json), files
#: that only look like model files (embeddings.safetensors, .gitattributes) and plain notes.
_USERS_FILES = {
    "embeddings.safetensors": b"my embeddings", ".gitattributes": b"*.bin filter=lfs\n", "README.md": b"# My project\n",
    "config.json": b'{"mine": true}', "notes.txt": b"mine",
}


def _users_folder(path):
    path.mkdir()
    for name, content in _USERS_FILES.items():
        (path / name).write_bytes(content)
    (path / "runs").mkdir()
    (path / "runs" / "log.txt").write_text("run 1")
    return path


def test_a_later_save_removes_only_what_the_earlier_save_wrote(calibrator, tmp_path):
    """Files added beside a save (the user's, however they are named) survive the next save into it."""
    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    first = read_manifest(out)
    assert sorted(first) == sorted(os.listdir(out)) and "featcal_manifest.json" in first
    for name in ("embeddings.safetensors", ".gitattributes", "notes.txt"):
        (out / name).write_bytes(_USERS_FILES[name])
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("run 1")
    (out / "tokenizer.json").write_text("{}")  # not in the manifest: the user's, kept
    calibrator.save_model(out)
    for name in ("embeddings.safetensors", ".gitattributes", "notes.txt"):
        assert (out / name).read_bytes() == _USERS_FILES[name], name
    assert (out / "runs" / "log.txt").read_text() == "run 1" and (out / "tokenizer.json").read_text() == "{}"
    assert sorted(read_manifest(out)) == sorted(first)
    assert _leftovers(tmp_path) == [] and not [n for n in os.listdir(out) if n.startswith(".featcal-")]
    with pytest.raises(ValueError, match=r"`output_dir` .* is a file"):
        calibrator.save_model(out / "notes.txt")


def test_a_folder_that_is_not_a_save_is_refused_unless_overwriting(calibrator, tmp_path):
    """A repository-like folder without a manifest: refused, naming what is there, nothing changed;
    with overwrite=True this save's files replace same-named ones and every other file stays."""
    out = _users_folder(tmp_path / "project")
    before = _snapshot(out)
    with pytest.raises(ValueError) as info:
        calibrator.save_model(out)
    message = str(info.value)
    assert message.startswith(f"`output_dir` {str(out)!r} is not empty and is not an earlier hf_featcal save")
    for name in (".gitattributes", "README.md", "config.json", "embeddings.safetensors", "notes.txt", "runs"):
        assert name in message, name
    assert "overwrite=True" in message and "--overwrite" in message
    assert _snapshot(out) == before and _leftovers(out) == [".gitattributes"] and _leftovers(tmp_path) == []

    calibrator.save_model(out, overwrite=True)
    written = read_manifest(out)
    for name in ("embeddings.safetensors", ".gitattributes", "notes.txt"):
        assert (out / name).read_bytes() == _USERS_FILES[name], name
        assert name not in written
    assert (out / "runs" / "log.txt").read_text() == "run 1"
    assert json.loads((out / "config.json").read_text())["model_type"] == "clip_vision_model"  # replaced, as documented
    calibrator.save_model(out)  # now an earlier save: no overwrite needed, the user's files still kept
    assert (out / "embeddings.safetensors").read_bytes() == _USERS_FILES["embeddings.safetensors"]
    assert _leftovers(out) == [".gitattributes"] and _leftovers(tmp_path) == []


def test_a_damaged_manifest_is_not_trusted(calibrator, tmp_path):
    """A manifest naming entries outside the folder (or unreadable) is no manifest: the folder is refused."""
    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    (out / "featcal_manifest.json").write_text(json.dumps({"files": ["../elsewhere", "model.safetensors"]}))
    with pytest.raises(ValueError, match="not an earlier hf_featcal save"):
        calibrator.save_model(out)


def test_an_existing_target_is_staged_inside_itself(calibrator, tmp_path, monkeypatch):
    """A mount point (Docker / Kubernetes volume): renames across its boundary fail with EXDEV and it
    cannot be removed (EBUSY). The save stages inside it, so every rename stays on its file system."""
    mount = tmp_path / "volume"
    mount.mkdir()
    real_rename, real_rmdir, renames = os.rename, os.rmdir, []

    def inside(path) -> bool:
        return os.path.realpath(path) == str(mount) or os.path.realpath(path).startswith(str(mount) + os.sep)

    def rename(source, destination):
        renames.append((os.fspath(source), os.fspath(destination)))
        if inside(source) != inside(destination):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(source, destination)

    def rmdir(path, *args, **kwargs):
        if os.path.realpath(path) == str(mount):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "rmdir", rmdir)
    calibrator.save_model(mount)  # empty mount point
    (mount / "notes.txt").write_text("mine")
    calibrator.save_model(mount)  # a later save into it
    monkeypatch.undo()
    assert renames and all(inside(a) and inside(b) for a, b in renames)
    assert sorted(os.listdir(mount)) == sorted([*read_manifest(mount), "notes.txt"])
    assert {"config.json", "model.safetensors", "README.md", "featcal_manifest.json"} <= set(os.listdir(mount))
    assert _leftovers(tmp_path) == []
    reloaded = CLIPVisionModel.from_pretrained(mount)
    for name, value in calibrator.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


@contextlib.contextmanager
def _read_only(*folders):
    """Make `folders` refuse new entries, also for root (who ignores permission bits): the immutable
    attribute there (skipped where it cannot be set)."""
    as_root = os.geteuid() == 0
    done = []
    try:
        for folder in folders:
            if as_root:
                if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
                    pytest.skip("cannot make a folder read-only for root here (chattr +i)")
            else:
                folder.chmod(0o555)
            done.append(folder)
        yield
    finally:
        for folder in done:
            if as_root:
                subprocess.run(["chattr", "-i", str(folder)], check=True)
            else:
                folder.chmod(0o755)


def test_one_writability_rule_up_front_and_at_the_save(calibrator, tmp_path):
    """The old rules disagreed on an existing writable folder whose parent is read-only (the up-front
    probe accepted it, the save refused it after calibrating). Now both accept it and the save works;
    a read-only folder is refused by both, naming the argument."""
    from hf_featcal.recipes import RecipeError, check_output_dir

    parent = tmp_path / "read-only"
    out = parent / "calibrated"
    out.mkdir(parents=True)
    locked = tmp_path / "locked"
    locked.mkdir()
    with _read_only(parent, locked):
        check_output_dir(str(out))  # the CLI's / recipes' early check
        calibrator.save_model(out)
        assert "model.safetensors" in os.listdir(out)
        calibrator.save_model(out)  # and again, into the earlier save
        with pytest.raises(RecipeError, match=r"output_dir: .* is not writable"):
            check_output_dir(str(locked))
        with pytest.raises(ValueError, match=r"`output_dir` .* is not writable"):
            calibrator.save_model(locked)


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

    hub_stand_in(monkeypatch)  # a token, no repository yet; the calls below are recorded here
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
    assert deleted == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json"]


@pytest.fixture
def calibrator_of_folders(clip_setting, tmp_path):
    """A calibrator whose merged model, base and experts are read from folders."""
    base, experts, merged, data = clip_setting
    base.save_pretrained(tmp_path / "base")
    merged.save_pretrained(tmp_path / "merged")
    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / "experts" / task)
    merged = CLIPVisionModel.from_pretrained(tmp_path / "merged").eval()
    calibrator = FeatCalCalibrator(merged, str(tmp_path / "base"), {t: str(tmp_path / "experts" / t) for t in experts},
                                   data, FeatCalConfig(num_samples_per_task=10), show_progress=False)
    calibrator.calibrate()
    return calibrator


@pytest.mark.parametrize(("where", "relation", "argument"), [
    ("experts/cars", "is", "experts['cars']"),
    ("link-to-expert", "is", "experts['cars']"),
    ("base/calibrated", "lies inside", "base_model"),
    ("experts", "contains", "experts['cars']"),
    ("merged", "is", "model"),
])
def test_saving_into_a_folder_the_run_reads_is_refused(calibrator_of_folders, tmp_path, where, relation, argument):
    (tmp_path / "link-to-expert").symlink_to(tmp_path / "experts" / "cars", target_is_directory=True)
    inputs = {name: _snapshot(tmp_path / name) for name in ("base", "merged", "experts")}
    with pytest.raises(ValueError) as info:
        calibrator_of_folders.save_model(tmp_path / where, overwrite=True)  # not even when overwriting
    assert str(info.value).startswith(f"`output_dir` {str(tmp_path / where)!r} {relation} the folder of `{argument}`")
    assert {name: _snapshot(tmp_path / name) for name in inputs} == inputs
    assert not (tmp_path / "base" / "calibrated").exists()


def test_a_file_put_beside_a_save_is_not_replaced_without_overwrite(calibrator, tmp_path):
    """A later save that would write a name the earlier save did not (the user's file now): refused,
    nothing changed; with overwrite=True it is replaced, as documented."""
    from transformers import CLIPImageProcessor

    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    (out / "preprocessor_config.json").write_text('{"mine": true}')
    before = _snapshot(out)
    processor = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    with pytest.raises(
        ValueError, match=r"this save writes \['preprocessor_config.json'\], which the earlier save there did not write"
    ):
        calibrator.save_model(out, processing_class=processor)
    assert _snapshot(out) == before and _leftovers(tmp_path) == [] and _leftovers(out) == []
    calibrator.save_model(out, processing_class=processor, overwrite=True)
    assert "preprocessor_config.json" in read_manifest(out)
    assert "mine" not in (out / "preprocessor_config.json").read_text()


_KILLED_SAVE = """
import os, shutil, sys
from hf_featcal import saving

folder, source, kill_at = sys.argv[1:]
with saving.atomic_folder(folder) as staging:
    for name in os.listdir(source):  # the new save: the files of a model saved at `source`
        shutil.copy(os.path.join(source, name), staging)
    if kill_at == "cleanup":  # every entry renamed in; killed while deleting the old ones
        shutil.rmtree = lambda *args, **kwargs: os._exit(9)
    else:  # killed before the kill_at-th rename of the swap: no `except`, no `finally` runs
        renames, real = [], os.rename
        def rename(source, destination):
            renames.append(source)
            if len(renames) == int(kill_at):
                os._exit(9)
            real(source, destination)
        os.rename = rename
"""


@pytest.mark.parametrize(("kill_at", "repaired_by", "expected"), [
    ("3", "load", "old"), ("3", "save", "new save"), ("cleanup", "load", "new"),
])
def test_a_save_killed_between_its_renames_is_repaired_by_the_next_load_or_save(tmp_path, kill_at, repaired_by,
                                                                                 expected):
    """SIGKILL in the middle of a re-save's renames leaves old entries in a hidden folder and new ones
    half in: the next load (or save) there restores the old save, or finishes the new one when all its
    entries were in; either way a folder that loads as one save, with no hidden folder left."""
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_featcal.model_io import load_model

    def tiny(seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1))

    folder = tmp_path / "out"
    with atomic_folder(folder) as staging:
        tiny(0).save_pretrained(staging)
    tiny(1).save_pretrained(tmp_path / "new")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(folder), str(tmp_path / "new"), kill_at],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 9, killed.stderr
    assert any(name.startswith(".featcal-previous-") for name in os.listdir(folder))  # the broken state

    with pytest.warns(UserWarning, match="interrupted between its renames"):
        if repaired_by == "load":
            loaded = load_model(str(folder), "model")
        else:
            with atomic_folder(folder) as staging:
                tiny(2).save_pretrained(staging)
            loaded = load_model(str(folder), "model")
    want = {"old": tiny(0), "new": tiny(1), "new save": tiny(2)}[expected]
    for (name, value), reference in zip(loaded.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(value, reference), name
    assert sorted(os.listdir(folder)) == sorted(read_manifest(folder))  # no hidden folder, nothing stray
