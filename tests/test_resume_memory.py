"""A resume holds the finished blocks' checkpointed parameters one block at a time (read, write into
the model, release — file mapping included — then the next block), gives the uninterrupted result
bit for bit, and refuses a damaged block file before reading or writing any parameter."""

from __future__ import annotations

import os
import re
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_featcal.checkpointing import CheckpointFolder
from hf_featcal.parameters import ModelParameters
from test_resume import _run
from test_t5 import build_t5_setting

FINISHED = 3  # of the T5's 4 blocks (2 encoder + 2 decoder): interrupted while calibrating the 4th


@pytest.fixture
def t5_setting(generator):
    base, experts, merged, data = build_t5_setting(generator, tasks=("a", "b"))
    return merged, base, experts, data


def _interrupted(setting, folder, monkeypatch) -> None:
    merged, base, experts, data = setting
    with pytest.raises(KeyboardInterrupt):
        _run(merged, base, experts, data, folder, interrupt_at=FINISHED + 1, monkeypatch=monkeypatch)
    assert sorted(n for n in os.listdir(folder) if n.startswith("block-")) == [
        f"block-{i:05d}.safetensors" for i in range(1, FINISHED + 1)
    ]


def _mapped_block_files(folder) -> set[str]:
    """The checkpoint's block files this process has memory-mapped now (Linux: /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if len(line.split()) == 6}
    prefix = os.path.join(os.path.realpath(folder), "block-")
    return {os.path.basename(p) for p in paths if p.startswith(prefix)}


class _Watch:
    """Wraps `CheckpointFolder.read_block` and `ModelParameters.write`: weak references to every
    tensor read, and what was still alive (and mapped) at each read and each write."""

    def __init__(self, monkeypatch, folder) -> None:
        self.folder, self.has_maps = folder, os.path.exists("/proc/self/maps")
        self.live: list[tuple[int, weakref.ref]] = []  # (block index, tensor)
        self.reads: list[int] = []
        self.alive_at_read: list[list[int]] = []  # block indices of tensors still alive when a block is read
        self.mapped_at_read: list[set[str]] = []
        self.alive_at_write: list[set[int]] = []  # blocks with tensors alive during each write
        self.writes = 0
        read_block, write = CheckpointFolder.read_block, ModelParameters.write

        def reading(folder_self, index):
            self.alive_at_read.append(self.alive())
            self.mapped_at_read.append(_mapped_block_files(self.folder) if self.has_maps else set())
            tensors = read_block(folder_self, index)
            self.reads.append(index)
            self.live.extend((index, weakref.ref(t)) for t in tensors.values())
            return tensors

        def writing(params_self, name, value):
            self.writes += 1
            self.alive_at_write.append(set(self.alive()))
            return write(params_self, name, value)

        monkeypatch.setattr(CheckpointFolder, "read_block", reading)
        monkeypatch.setattr(ModelParameters, "write", writing)

    def alive(self) -> list[int]:
        return [index for index, ref in self.live if ref() is not None]


def test_resume_holds_one_block_at_a_time_and_gives_the_uninterrupted_result(t5_setting, tmp_path, monkeypatch):
    merged, base, experts, data = t5_setting
    expected, reference, _ = _run(merged, base, experts, data, monkeypatch=monkeypatch)
    folder = tmp_path / "ckpt"
    _interrupted(t5_setting, folder, monkeypatch)
    per_block = [len(load_file(folder / f"block-{i:05d}.safetensors")) for i in range(1, FINISHED + 1)]
    assert all(n > 0 for n in per_block)

    watch = _Watch(monkeypatch, folder)
    resumed, calibrator, calls = _run(merged, base, experts, data, folder, monkeypatch=monkeypatch)

    assert watch.reads == list(range(1, FINISHED + 1))  # every finished block, each read once, in order
    assert len(watch.live) == sum(per_block)
    # when a block is read, nothing of the blocks before it is held any more, nor is its file mapped
    assert watch.alive_at_read == [[]] * FINISHED
    assert watch.mapped_at_read == [set()] * FINISHED
    # while the checkpoint's parameters are written, only the block being written is held
    resume_writes = watch.alive_at_write[: sum(per_block)]
    assert resume_writes == [{i} for i, n in enumerate(per_block, 1) for _ in range(n)]
    assert watch.alive() == []
    if watch.has_maps:
        assert _mapped_block_files(folder) == set()

    assert calls == [(1, 1)]  # only the decoder's second block was calibrated again
    for (name, p), q in zip(resumed.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert calibrator.report.to_dict() == reference.report.to_dict()
    assert len(calibrator.solve_log) == len(reference.solve_log)


def _tamper_shape(path) -> str:
    tensors = load_file(path)
    key = sorted(k for k, v in tensors.items() if v.dim() == 2)[0]
    tensors[key] = tensors[key][:-1].clone()  # one row fewer
    save_file(tensors, path)
    return key


def _tamper_name(path) -> str:
    tensors = load_file(path)
    tensors["decoder.block.9.layer.0.SelfAttention.q.weight"] = tensors.pop(sorted(tensors)[0])
    save_file(tensors, path)
    return "decoder.block.9.layer.0.SelfAttention.q.weight"


def _truncate(path) -> str:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size - 8)
    return ""


@pytest.mark.parametrize(
    "tamper, block, message",
    [
        (_tamper_shape, 3, r"'{key}' has shape \[\d+, \d+\], the model's parameter \[\d+, \d+\]"),
        (_tamper_name, 3, r"'{key}' is not a parameter of the model"),
        (_truncate, 2, r""),  # safetensors' own words about the short file
    ],
)
def test_a_damaged_block_file_is_refused_before_any_parameter_is_read_or_written(
    t5_setting, tmp_path, monkeypatch, tamper, block, message
):
    merged, base, experts, data = t5_setting
    folder = tmp_path / "ckpt"
    _interrupted(t5_setting, folder, monkeypatch)
    intact = tmp_path / "intact"
    shutil.copytree(folder, intact)
    name = f"block-{block:05d}.safetensors"
    key = tamper(folder / name)

    watch = _Watch(monkeypatch, folder)
    with pytest.raises(ValueError,
                       match=rf"`checkpoint_dir` .* is damaged \({name}: {message.format(key=re.escape(key))}"):
        _run(merged, base, experts, data, folder, monkeypatch=monkeypatch)
    assert watch.reads == [] and watch.writes == 0  # refused on the headers alone
    # the intact copy resumes: the refusal was about the tampered file
    _run(merged, base, experts, data, intact, monkeypatch=monkeypatch)
    assert watch.reads == list(range(1, FINISHED + 1))
