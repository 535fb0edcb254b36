"""Experts and base given as folders are read one block at a time from safetensors."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator
from hf_featcal.experts import CheckpointSource, InMemorySource, make_source
from test_t5 import randomise_t5_norms, seq2seq_batch, t5_config
from testing_utils import assert_same_up_to_rounding, perturbed, task_arithmetic


def _calibrate(merged, base, experts, data):
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
    calibrator.calibrate()
    return model, calibrator


def test_folders_give_the_in_memory_result_and_read_one_block_at_a_time(clip_setting, tmp_path, monkeypatch):
    base, experts, merged, data = clip_setting
    base.save_pretrained(tmp_path / "base", max_shard_size="20KB")  # sharded: model.safetensors.index.json
    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / task)
    assert (tmp_path / "base" / "model.safetensors.index.json").exists()

    reads: list[tuple[str, str]] = []  # (phase, key)
    phase = {"now": "other"}
    original_read, original_block = CheckpointSource._read, CheckpointSource.block

    def read(self, key):
        reads.append((phase["now"], key))
        return original_read(self, key)

    def block(self, reference, stack, index, device):
        phase["now"] = f"block{index}"
        try:
            return original_block(self, reference, stack, index, device)
        finally:
            phase["now"] = "other"

    monkeypatch.setattr(CheckpointSource, "_read", read)
    monkeypatch.setattr(CheckpointSource, "block", block)

    expected, _ = _calibrate(merged, base, experts, data)
    got, calibrator = _calibrate(merged, str(tmp_path / "base"), {t: str(tmp_path / t) for t in experts}, data)
    assert all(isinstance(s, CheckpointSource) for s in calibrator.experts.values())
    assert_same_up_to_rounding(got.named_parameters(), expected.named_parameters())

    assert reads
    for where, key in reads:
        if where.startswith("block"):
            assert key.startswith(f"encoder.layers.{where[5:]}."), (where, key)
        else:  # entering the stack: only the input path, never a block
            assert ".layers." not in key, key


def test_t5_folders_with_tied_embeddings(generator, tmp_path):
    for tie in (False, True):
        config = t5_config(tie_word_embeddings=tie, feed_forward_proj="relu" if tie else "gated-gelu")
        base = T5ForConditionalGeneration(config).eval()
        randomise_t5_norms(base, generator)
        experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
        merged = task_arithmetic(base, experts)
        data = {t: [seq2seq_batch(generator)] for t in experts}
        for task, expert in experts.items():
            expert.save_pretrained(tmp_path / f"{tie}-{task}")
        expected, _ = _calibrate(merged, base, experts, data)
        got, calibrator = _calibrate(merged, base, {t: str(tmp_path / f"{tie}-{t}") for t in experts}, data)
        assert isinstance(calibrator.experts["a"], CheckpointSource)
        assert_same_up_to_rounding(got.named_parameters(), expected.named_parameters())


def test_bin_only_checkpoints_are_loaded_whole(clip_setting, tmp_path):
    from hf_featcal.architectures import get_layer_map

    base, experts, merged, data = clip_setting
    # transformers 5 always writes safetensors: write a legacy `.bin`-only checkpoint by hand
    (tmp_path / "bin").mkdir()
    experts["cars"].config.save_pretrained(tmp_path / "bin")
    torch.save(experts["cars"].state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    source = make_source(str(tmp_path / "bin"), "experts['cars']", get_layer_map(merged))
    assert isinstance(source, InMemorySource)
    expected, _ = _calibrate(merged, base, experts, data)
    got, _ = _calibrate(merged, base, {**experts, "cars": str(tmp_path / "bin")}, data)
    assert_same_up_to_rounding(got.named_parameters(), expected.named_parameters())


def test_folder_with_missing_block_tensors_is_refused(clip_setting, tmp_path):
    from safetensors.torch import save_file

    base, experts, merged, data = clip_setting
    folder = tmp_path / "partial"
    experts["cars"].config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in experts["cars"].state_dict().items() if "layers.1.mlp" not in k}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"`experts\['cars'\]`.*lacks parameters of the merged model's tower"):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(folder)}, data)


def test_a_block_read_from_a_folder_holds_the_checkpoints_tensors_and_leaves_the_merged_block_alone(
    clip_setting, tmp_path
):
    """`CheckpointSource.block` gives the expert's block (its tensors taken from the checkpoint
    without a copy of the merged block's), in eval mode, converted to the merged model's dtype;
    the merged model's own block keeps its values and shares no memory with it."""
    from hf_featcal.architectures import get_layer_map

    base, experts, merged, _ = clip_setting
    copy.deepcopy(experts["cars"]).half().save_pretrained(tmp_path / "cars16")  # float16 into a float32 model
    layer_map = get_layer_map(merged)
    source = CheckpointSource(str(tmp_path / "cars16"), "experts['cars']", "cars16", layer_map)
    merged_block = layer_map.stacks(layer_map.tower(merged))[0].blocks[1]
    before = {k: v.clone() for k, v in merged_block.state_dict().items()}
    block = source.block(merged, 0, 1, torch.device("cpu"))
    expert = copy.deepcopy(experts["cars"]).half().float()  # what the float16 file holds
    expert_block = layer_map.stacks(layer_map.tower(expert))[0].blocks[1]
    assert not block.training and block is not merged_block
    merged_pointers = {p.data_ptr() for p in merged_block.parameters()}
    for (name, got), (_, want) in zip(block.named_parameters(), expert_block.named_parameters(), strict=True):
        assert isinstance(got, torch.nn.Parameter) and got.dtype == torch.float32, name
        assert got.data_ptr() not in merged_pointers, name
        assert torch.equal(got, want), name
    for name, value in merged_block.state_dict().items():
        assert torch.equal(value, before[name]), name
    hidden = torch.randn(2, 5, merged.config.hidden_size)
    torch.testing.assert_close(block(hidden, None)[0], expert_block(hidden, None)[0], rtol=1e-6, atol=1e-6)


def test_a_block_tensor_of_the_wrong_shape_is_refused_by_name(clip_setting, tmp_path):
    from safetensors.torch import save_file

    from hf_featcal.architectures import get_layer_map

    _, experts, merged, _ = clip_setting
    folder = tmp_path / "odd"
    experts["cars"].config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in experts["cars"].state_dict().items()}
    key = next(k for k in state if k.endswith("layers.0.mlp.fc1.weight"))
    state[key] = state[key][:-1].contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    source = CheckpointSource(str(folder), "experts['cars']", "odd", get_layer_map(merged))
    with pytest.raises(ValueError, match=r"`experts\['cars'\]`.*fc1\.weight has shape .*, the merged model's"):
        source.block(merged, 0, 0, torch.device("cpu"))
