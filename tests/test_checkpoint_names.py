"""Checkpoints whose keys transformers renames on load (its checkpoint conversion mapping): transformers 5
saves ViT under the legacy names (`encoder.layer.N.attention.attention.query`, ...) and loads them into
`layers.N.attention.q_proj`; the lazy readers name the stored tensors the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from transformers import ViTConfig, ViTForImageClassification, ViTModel

from hf_featcal import FeatCalCalibrator
from hf_featcal.architectures import get_layer_map
from hf_featcal.experts import CheckpointSource, make_source
from hf_featcal.merging import task_arithmetic
from testing_utils import perturbed, pixel_batches, randomise_norms


def _vit(model_class, generator):
    config = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       image_size=8, patch_size=4, num_labels=3)
    model = model_class(config).eval()
    randomise_norms(model, generator)
    return model


@pytest.mark.parametrize("model_class", [ViTModel, ViTForImageClassification])
def test_a_saved_vit_is_read_lazily_block_by_block_as_the_model_in_memory(model_class, generator, tmp_path):
    model = _vit(model_class, generator)
    model.save_pretrained(tmp_path / "vit")
    with safe_open(str(tmp_path / "vit" / "model.safetensors"), "pt") as handle:
        stored = set(handle.keys())
    # the premise: the file holds names the model does not have (else this tests nothing)
    assert any(".attention.attention.query." in key for key in stored)
    assert not stored & {k for k in model.state_dict() if ".q_proj." in k}
    layer_map = get_layer_map(model)
    source = make_source(str(tmp_path / "vit"), "experts['a']", layer_map)
    assert isinstance(source, CheckpointSource)
    tower = layer_map.tower(model)
    assert source.tower_shapes(model) == {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    blocks = layer_map.stacks(tower)[0].blocks
    for index, block in enumerate(blocks):
        got = source.block(model, 0, index, torch.device("cpu")).state_dict()
        want = block.state_dict()
        assert list(got) == list(want)
        for key, value in want.items():
            assert torch.equal(got[key], value), f"block {index}: {key}"
    with source.entry_tower(model) as entry:  # the input path: the checkpoint's, written into the model
        for key, value in entry.state_dict().items():
            assert torch.equal(value, tower.state_dict()[key]), key


def test_featcal_with_vit_folders_equals_featcal_with_the_models_in_memory(generator, tmp_path):
    base = _vit(ViTModel, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: pixel_batches(generator, [6, 6]) for t in experts}
    base.save_pretrained(tmp_path / "base")
    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / task)
    in_memory = copy.deepcopy(merged)
    FeatCalCalibrator(in_memory, base, experts, data, show_progress=False).calibrate()
    from_folders = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(from_folders, str(tmp_path / "base"), {t: str(tmp_path / t) for t in experts},
                                   data, show_progress=False)
    assert all(isinstance(s, CheckpointSource) for s in calibrator.experts.values())
    calibrator.calibrate()
    assert any(not torch.equal(a, b) for a, b in zip(in_memory.parameters(), merged.parameters(), strict=True))
    # bit for bit: the folders' tensors are the models' (the project's float32 runs may differ in the last
    # bits by memory alignment, `testing_utils.SAME_RESULT_RTOL`; here they are equal)
    for (name, got), want in zip(from_folders.named_parameters(), in_memory.parameters(), strict=True):
        assert torch.equal(got, want), name
    # the merge engine reads the folders by the same names
    merged_from_folders = task_arithmetic(str(tmp_path / "base"), {t: str(tmp_path / t) for t in experts})
    for (name, got), want in zip(merged_from_folders.state_dict().items(), merged.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_a_checkpoint_whose_conversion_changes_tensors_is_loaded_whole(generator, tmp_path):
    """Mixtral's conversion fuses the stored per-expert weights (`experts.N.w1` ...) into one tensor
    (`experts.gate_up_proj`): no stored tensor is one of the model's, so the folder is loaded whole, by
    `from_pretrained`, and merges as the model in memory does."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_featcal.model_io import resolve_checkpoint

    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    base = MixtralForCausalLM(config).eval()
    expert = perturbed(base, generator, 0.05).eval()
    base.save_pretrained(tmp_path / "base")
    expert.save_pretrained(tmp_path / "a")
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as handle:
        assert not set(handle.keys()) & {k for k in expert.state_dict() if ".experts." in k}  # the premise
    checkpoint = resolve_checkpoint(str(tmp_path / "a"), "experts['a']")
    assert checkpoint.folder is not None and not checkpoint.lazy
    want = task_arithmetic(base, {"a": expert}, scaling_factor=0.5).state_dict()
    got = task_arithmetic(str(tmp_path / "base"), {"a": str(tmp_path / "a")}, scaling_factor=0.5).state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
