"""One checkpoint reader for merging and calibration (`hf_featcal.model_io`): the same folder gives the
same tensors to both, where the two used to follow different key-prefix and LoRA-path rules."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import CLIPModel, CLIPVisionModel, LlamaConfig, LlamaForCausalLM, LlamaModel

from hf_featcal.architectures import get_layer_map
from hf_featcal.experts import make_source
from hf_featcal.merging import task_arithmetic
from hf_featcal.model_io import tower_key_map
from testing_utils import tiny_clip_config

CPU = torch.device("cpu")


def _adapter(model, folder, seed, **config):
    """Save a LoRA adapter with random (non-zero) B on `model`; return the expert in full."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **config))
    peft_model.save_pretrained(folder)
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def _recorded_class(folder):
    with open(folder / "adapter_config.json", encoding="utf-8") as handle:
        return (json.load(handle).get("auto_mapping") or {}).get("base_model_class")


def _calibration_blocks(folder, base, reference):
    """The blocks calibration reads for the adapter expert at `folder` (on `base`), per block index."""
    layer_map = get_layer_map(reference)
    source = make_source(str(folder), "experts['a']", layer_map, make_source(base, "base_model", layer_map))
    blocks = layer_map.stacks(layer_map.tower(reference))[0].blocks
    return [source.block(reference, 0, i, CPU).state_dict() for i in range(len(blocks))]


def test_lora_adapter_of_the_vision_tower_without_a_recorded_class_into_a_clip_model(tmp_path):
    # PEFT records the trained-on class only without a task_type: with one, merging used to look for the
    # adapted modules at the CLIPModel's top level and refuse, while calibration found them in the tower
    torch.manual_seed(0)
    clip = CLIPModel(tiny_clip_config()).eval()
    vision = CLIPVisionModel(clip.config.vision_config).eval()
    vision.load_state_dict(clip.vision_model.state_dict())
    full = _adapter(vision, tmp_path / "a", 1, r=2, target_modules=["q_proj", "fc1"], task_type="FEATURE_EXTRACTION")
    assert _recorded_class(tmp_path / "a") is None

    merged = task_arithmetic(clip, {"a": str(tmp_path / "a")}, scaling_factor=0.5)
    base_vision, full_state = vision.state_dict(), full.state_dict()
    changed = 0
    for key, value in merged.vision_model.state_dict().items():
        want = base_vision[key] + 0.5 * (full_state[key] - base_vision[key])
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(value, base_vision[key])
    assert changed == 2 * 2  # q_proj and fc1 weights of both layers, nothing else
    for key, value in clip.text_model.state_dict().items():  # same layer names, other tower: untouched
        assert torch.equal(merged.text_model.state_dict()[key], value), key

    # calibration reads the same expert: every block is the full expert's block
    for index, block in enumerate(_calibration_blocks(tmp_path / "a", clip, clip)):
        want = {k[len(f"encoder.layers.{index}."):]: v for k, v in full_state.items()
                if k.startswith(f"encoder.layers.{index}.")}
        assert block.keys() == want.keys()
        for key, value in block.items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)


def _tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def test_causal_lm_lora_adapter_on_a_decoder_base(tmp_path):
    # a CAUSAL_LM adapter names modules `model.layers...`; with a LlamaModel base (`layers...`) merging
    # used to refuse it while calibration stripped the `model.` prefix
    torch.manual_seed(0)
    causal = LlamaForCausalLM(_tiny_llama()).eval()
    decoder = LlamaModel(causal.config).eval()
    decoder.load_state_dict(causal.model.state_dict())
    full = _adapter(causal, tmp_path / "a", 2, r=2, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM")
    assert _recorded_class(tmp_path / "a") is None

    merged = task_arithmetic(decoder, {"a": str(tmp_path / "a")}, scaling_factor=0.3)
    full_decoder = full.model.state_dict()
    changed = 0
    for key, value in merged.state_dict().items():
        base = decoder.state_dict()[key]
        torch.testing.assert_close(value, base + 0.3 * (full_decoder[key] - base), rtol=1e-5, atol=1e-6, msg=key)
        changed += not torch.equal(value, base)
    assert changed == 2 * 2

    for index, block in enumerate(_calibration_blocks(tmp_path / "a", decoder, decoder)):
        prefix = f"layers.{index}."
        want = {k[len(prefix):]: v for k, v in full_decoder.items() if k.startswith(prefix)}
        for key, value in block.items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_transformers4_clip_folder_with_a_stale_index_reads_alike(tmp_path):
    # one folder, two odd things at once: a stale shard index of expert B next to expert A's single file,
    # written the transformers-4 way (keys under `vision_model.`); both stacks must read A
    torch.manual_seed(0)
    base = CLIPVisionModel(tiny_clip_config().vision_config).eval()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for p in b.parameters():
            p.sub_(0.1 * torch.randn_like(p))
    folder = tmp_path / "expert"
    b.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    state = {"vision_model." + k: v.detach().contiguous() for k, v in a.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    merged = task_arithmetic(base, {"a": str(folder)}, scaling_factor=1.0)
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(value, a.state_dict()[key], rtol=0, atol=1e-6, msg=key)

    layer_map = get_layer_map(base)
    source = make_source(str(folder), "experts['a']", layer_map)
    for index, layer in enumerate(a.encoder.layers):
        block = source.block(base, 0, index, CPU).state_dict()
        for key, value in layer.state_dict().items():
            assert torch.equal(block[key], value), key
    with source.entry_tower(copy.deepcopy(base)) as tower:
        assert torch.equal(tower.embeddings.patch_embedding.weight, a.embeddings.patch_embedding.weight)


def test_tower_key_map_prefers_the_family_prefixes_then_derives_one():
    names = ["layers.0.w", "norm.w"]
    # both "" and "model." hold every name: the family's order decides
    keys = {"layers.0.w", "norm.w", "model.layers.0.w", "model.norm.w"}
    assert tower_key_map(names, keys, ("model.", ""))[0] == {n: "model." + n for n in names}
    assert tower_key_map(names, keys, ("", "model."))[0] == {n: n for n in names}
    # a wrapper prefix no family lists is found from the keys
    mapping, _ = tower_key_map(names, {"backbone.layers.0.w", "backbone.norm.w", "head.w"}, ("",))
    assert mapping == {n: "backbone." + n for n in names}
    # tied names and buffers checkpoints do not store
    mapping, _ = tower_key_map(["a.w", "b.w", "pos"], {"x.a.w"}, ("x.",), tied={"b.w": "a.w"}, optional={"pos"})
    assert mapping == {"a.w": "x.a.w", "b.w": "x.a.w"}
    mapping, errors = tower_key_map(names, {"layers.0.w"}, ("", "model."))
    assert mapping is None and len(errors) == 2 and "norm.w" in errors[0]


def test_lora_adapter_for_another_model_is_refused_by_both(tmp_path):
    torch.manual_seed(0)
    clip = CLIPModel(tiny_clip_config()).eval()
    wide = CLIPVisionModel(tiny_clip_config(intermediate_size=48).vision_config).eval()
    _adapter(wide, tmp_path / "a", 0, r=2, target_modules=["fc1"])
    with pytest.raises(ValueError, match=r"experts\['a'\].*adapts modules.*lacks.*fc1"):
        task_arithmetic(clip, {"a": str(tmp_path / "a")})
    with pytest.raises(ValueError, match=r"experts\['a'\].*adapts modules.*lacks.*fc1"):
        _calibration_blocks(tmp_path / "a", clip, clip)


def test_lora_adapter_of_the_text_tower_merges_there_and_is_refused_by_calibration(tmp_path):
    # the recorded class places a CLIPTextModel adapter on `text_model` (same layer names and shapes as the
    # vision tower here); calibration, which calibrates the vision tower, refuses it instead of adding its
    # deltas to the vision blocks
    torch.manual_seed(0)
    clip = CLIPModel(tiny_clip_config()).eval()
    text = copy.deepcopy(clip.text_model)
    full = _adapter(text, tmp_path / "t", 3, r=2, target_modules=["q_proj"])
    assert _recorded_class(tmp_path / "t") == "CLIPTextModel"
    merged = task_arithmetic(clip, {"t": str(tmp_path / "t")}, scaling_factor=1.0)
    for key, value in merged.text_model.state_dict().items():
        torch.testing.assert_close(value, full.state_dict()[key], rtol=1e-5, atol=1e-6, msg=key)
    for key, value in clip.vision_model.state_dict().items():
        assert torch.equal(merged.vision_model.state_dict()[key], value), key
    with pytest.raises(ValueError,
                       match=r"trained on CLIPTextModel \('text_model'\).*not part of the calibrated tower"):
        _calibration_blocks(tmp_path / "t", clip, clip)
