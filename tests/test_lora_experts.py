"""Experts given as PEFT LoRA adapters on the base: base + the adapter's delta, built per block."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import CLIPVisionModel

from hf_featcal import FeatCalCalibrator
from hf_featcal.experts import LoraSource


def _adapter(base, folder, seed, **config):
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    peft_model.save_pretrained(folder)
    return copy.deepcopy(peft_model).merge_and_unload().eval()  # the expert in full, for reference


@pytest.mark.parametrize("base_on_disk", [False, True])
def test_lora_adapter_experts_equal_their_merged_models(clip_setting, tmp_path, base_on_disk):
    base, _, _, data = clip_setting
    configs = {
        "cars": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"]),
        "dtd": dict(r=2, lora_alpha=4, target_modules=["out_proj", "fc2"], use_rslora=True,
                    alpha_pattern={"fc2": 16}),
    }
    full = {task: _adapter(base, tmp_path / task, seed, **cfg) for seed, (task, cfg) in enumerate(configs.items())}
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, value in merged.state_dict().items():
            value += 0.3 * sum(e.state_dict()[name] - base.state_dict()[name] for e in full.values())
    base_arg = base
    if base_on_disk:
        base.save_pretrained(tmp_path / "base")
        base_arg = str(tmp_path / "base")
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, full, data, show_progress=False).calibrate()
    calibrator = FeatCalCalibrator(merged, base_arg, {t: str(tmp_path / t) for t in configs}, data, show_progress=False)
    assert all(isinstance(s, LoraSource) for s in calibrator.experts.values())
    base_state = copy.deepcopy(base.state_dict())
    calibrator.calibrate()
    for (name, p), q in zip(merged.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in base.state_dict().items():  # the base the deltas are added to is untouched
        assert torch.equal(value, base_state[name]), name


def test_lora_adapter_needs_a_base(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    _adapter(base, tmp_path / "a", 0, r=2, target_modules=["q_proj"])
    with pytest.raises(
        ValueError, match=r"`experts\['cars'\]` is a LoRA adapter: pass the model it was trained on as `base_model`"
    ):
        FeatCalCalibrator(merged, None, {**experts, "cars": str(tmp_path / "a")}, data)


def test_unsupported_adapters_are_refused(clip_setting, tmp_path):
    base, experts, merged, data = clip_setting
    _adapter(base, tmp_path / "dora", 0, r=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match=r"use_dora"):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "dora")}, data)
    _adapter(base, tmp_path / "embed", 0, r=2, target_modules=["q_proj", "patch_embedding"])
    with pytest.raises(ValueError, match=r"outside the blocks"):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "embed")}, data)


@pytest.mark.parametrize("method,params", [("task_arithmetic", {"scaling_factor": 0.3}),
                                            ("ties", {"scaling_factor": 0.3, "density": 0.5}),
                                            ("dare", {"scaling_factor": 0.3, "drop_rate": 0.5, "seed": 1})])
def test_merging_lora_adapters_equals_merging_their_full_models(clip_setting, tmp_path, method, params):
    from hf_featcal.merging import merge_models

    base = clip_setting[0]
    configs = {"cars": dict(r=4, lora_alpha=8, target_modules=["q_proj", "fc1"]),
               "dtd": dict(r=2, lora_alpha=2, target_modules=["q_proj", "fc2"])}
    full = {task: _adapter(base, tmp_path / task, seed, **cfg) for seed, (task, cfg) in enumerate(configs.items())}
    from_full = merge_models(base, full, method, **params)
    from_adapters = merge_models(base, {t: str(tmp_path / t) for t in configs}, method, **params)
    for (name, p), q in zip(from_adapters.state_dict().items(), from_full.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_merging_lora_adapters_trained_on_the_vision_tower_into_a_clip_model(tmp_path, generator):
    from transformers import CLIPModel

    from hf_featcal.merging import task_arithmetic
    from testing_utils import tiny_clip_config

    clip = CLIPModel(tiny_clip_config()).eval()
    vision_base = CLIPVisionModel(clip.config.vision_config).eval()
    vision_base.load_state_dict(clip.vision_model.state_dict())
    full = _adapter(vision_base, tmp_path / "a", 0, r=2, target_modules=["q_proj", "fc1"])
    merged = task_arithmetic(clip, {"a": str(tmp_path / "a")}, scaling_factor=0.5)
    want = {k: v + 0.5 * (full.state_dict()[k] - v) for k, v in vision_base.state_dict().items()}
    for k, v in want.items():
        torch.testing.assert_close(merged.vision_model.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    for k, v in clip.text_model.state_dict().items():
        assert torch.equal(merged.text_model.state_dict()[k], v)


def test_load_model_materialises_an_adapter_for_evaluation(clip_setting, tmp_path):
    from hf_featcal.experts import load_model

    base = clip_setting[0]
    base.save_pretrained(tmp_path / "base")
    from transformers import CLIPVisionModel as Vision

    on_disk = Vision.from_pretrained(tmp_path / "base")  # records its folder as name_or_path
    full = _adapter(on_disk, tmp_path / "a", 0, r=2, target_modules=["q_proj", "fc1"])
    for model in (load_model(str(tmp_path / "a"), "model"), load_model(str(tmp_path / "a"), "model", base=base)):
        for (name, p), q in zip(model.state_dict().items(), full.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    state = copy.deepcopy(base.state_dict())
    load_model(str(tmp_path / "a"), "model", base=base)
    assert all(torch.equal(v, state[k]) for k, v in base.state_dict().items())  # the given base is copied


def _adapter_with_trained_biases(base, folder, seed, bias):
    """A real adapter whose trainable biases (PEFT's `bias="all"` / `"lora_only"`) moved away from the base's."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj", "fc1"], init_lora_weights=False, bias=bias)
    )
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if parameter.requires_grad and name.endswith(".bias"):
                parameter.add_(torch.randn_like(parameter))
    peft_model.save_pretrained(folder)
    # the expert as PEFT applies the adapter folder (independently of this library's reading of it)
    return PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_lora_biases_are_applied_as_peft_does(clip_setting, tmp_path, bias):
    """Issue 29 item 4: the adapter's trained biases (and, with `bias="all"`, the pre-LayerNorm's outside
    the blocks) reach merging and FeatCal's expert reading exactly as PEFT's `merge_and_unload` applies them."""
    from hf_featcal.architectures import get_layer_map
    from hf_featcal.experts import InMemorySource
    from hf_featcal.merging import task_arithmetic

    base = clip_setting[0]
    full = _adapter_with_trained_biases(base, tmp_path / "a", 0, bias)
    moved = [
        k for k, v in base.state_dict().items() if k.endswith(".bias") and not torch.equal(v, full.state_dict()[k])
    ]
    assert len(moved) == (18 if bias == "all" else 4)  # the adapter does carry trained biases
    # merging: lambda = 1 gives the expert itself
    merged = task_arithmetic(base, {"a": str(tmp_path / "a")}, scaling_factor=1.0)
    for key, value in full.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # FeatCal's reading: every block, and the tower's input path
    layer_map = get_layer_map(base)
    source = LoraSource(str(tmp_path / "a"), "experts['a']", "a", InMemorySource(base, "base_model", layer_map))
    want_blocks = layer_map.stacks(layer_map.tower(full))[0].blocks
    for index, want in enumerate(want_blocks):
        got = source.block(base, 0, index, torch.device("cpu"))
        for (key, value), expected in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=f"block {index} {key}")
    before = copy.deepcopy(base.state_dict())
    with source.entry_tower(base) as tower:
        for key, value in layer_map.tower(full).state_dict().items():
            if not key.startswith("encoder."):
                torch.testing.assert_close(tower.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for key, value in base.state_dict().items():  # the base is itself again afterwards
        assert torch.equal(value, before[key]), key


def test_non_finite_adapter_is_named_when_opened(clip_setting, tmp_path):
    """Issue 29 item 7: an adapter with NaN/Inf is refused when opened, naming it and the tensor."""
    from hf_featcal.merging import task_arithmetic

    base, experts, merged, data = clip_setting
    peft_model = get_peft_model(copy.deepcopy(base),
                                LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    with torch.no_grad():
        peft_model.base_model.model.encoder.layers[1].self_attn.q_proj.lora_B["default"].weight[0, 0] = float("nan")
    peft_model.save_pretrained(tmp_path / "a")
    named = (r"`experts\['cars'\]`: the LoRA adapter .* has non-finite values \(NaN/Inf\) in "
             r"'base_model\.model\.encoder\.layers\.1\.self_attn\.q_proj\.lora_B\.weight'")
    with pytest.raises(ValueError, match=named):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "a")}, data)
    with pytest.raises(ValueError, match=named):
        task_arithmetic(base, {**experts, "cars": str(tmp_path / "a")})


def test_adapter_tensors_that_are_not_read_are_refused_not_dropped(clip_setting, tmp_path):
    """Issue 29 item 4, the class: an adapter tensor this library does not apply (here an Embedding's
    `lora_embedding_A/B`) used to be skipped silently; it is refused, naming the adapter and the tensor."""
    from hf_featcal.merging import task_arithmetic

    base, experts, merged, data = clip_setting
    _adapter(base, tmp_path / "a", 0, r=2, target_modules=["q_proj", "position_embedding"])
    named = (r"`experts\['cars'\]`: the LoRA adapter .* holds tensors other than LoRA A/B weights and biases"
             r".*lora_embedding_")
    with pytest.raises(ValueError, match=named):
        task_arithmetic(base, {**experts, "cars": str(tmp_path / "a")})
    with pytest.raises(ValueError, match=named):
        FeatCalCalibrator(merged, base, {**experts, "cars": str(tmp_path / "a")}, data)


def test_one_adapter_reader_gives_peft_s_weights_bit_for_bit_on_every_path(clip_setting, tmp_path):
    """Issue 38 item 1: one adapter folder is the same weights on every path — the merge engine's reader
    (merges; SVC, which reads the adapter on its `base_model`), FeatCal's per-block source (blocks and the
    tower's input path), and the whole expert of post-merging steps and compare (`load_model` on the run's
    base) — each bit-identical to PEFT's own `merge_and_unload` of the folder on that base."""
    import contextlib

    from hf_featcal.architectures import get_layer_map
    from hf_featcal.experts import InMemorySource, make_source
    from hf_featcal.merging.engine import canonical_keys, float_state, open_expert
    from hf_featcal.post_merging.surgery import _expert_model

    base = clip_setting[0]
    folder = str(tmp_path / "a")
    _adapter_with_trained_biases(base, folder, 3, "all")
    config = PeftModel.from_pretrained(copy.deepcopy(base), folder).peft_config["default"]
    assert config.lora_alpha == 8 and config.r == 2  # scaling 4: not a no-op
    # PEFT applies the folder to the base, independently of this library's reading
    want = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval().state_dict()
    adapted = [k for k, v in base.state_dict().items() if not torch.equal(v, want[k])]
    assert any(k.endswith("q_proj.weight") for k in adapted) and any(k.endswith("layer_norm1.bias") for k in adapted)

    def check(got: dict, path: str) -> None:
        for key, value in got.items():
            assert torch.equal(value.to(want[key].dtype), want[key]), f"{path}: {key}"

    # the merge engine: a merge (the base as the merge's own copy) and SVC (the base read as `base_model`)
    with contextlib.ExitStack() as stack:
        model = copy.deepcopy(base)
        state = float_state(model)
        canonical = canonical_keys(state)
        merge_reader = open_expert("a", folder, model, state, canonical, "the base", stack)
        base_reader = open_expert("base_model", base, model, state, canonical, "the base", stack, "`base_model`")
        svc_reader = open_expert("a", folder, model, state, canonical, "the base", stack, base=base_reader)
        assert set(merge_reader.keys) == set(svc_reader.keys) == set(adapted)
        check({key: merge_reader.read(key) for key in merge_reader.keys}, "merge")
        check({key: svc_reader.read(key) for key in svc_reader.keys}, "svc")
    # FeatCal's per-block source: every block, and the input path outside the blocks
    layer_map = get_layer_map(base)
    source = make_source(folder, "experts['a']", layer_map, InMemorySource(base, "base_model", layer_map))
    assert isinstance(source, LoraSource)
    assert layer_map.tower_prefix(base) == ""  # the tower's names are the model's
    for index in range(len(layer_map.stacks(base)[0].blocks)):
        prefix = f"encoder.layers.{index}."
        got = source.block(base, 0, index, torch.device("cpu")).state_dict()
        check({prefix + key: value for key, value in got.items()}, f"featcal block {index}")
    with source.entry_tower(base) as tower:
        check({k: v for k, v in tower.state_dict().items() if not k.startswith("encoder.")}, "featcal entry")
    # the whole expert: fit_surgery's loader (and compare's, `load_model` on the recipe's base)
    check(_expert_model(source, base).state_dict(), "surgery")
