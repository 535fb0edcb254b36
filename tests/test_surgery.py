"""Representation Surgery and ProbSurgery (`hf_featcal.post_merging`) against float64 references written
here from the papers' formulas: the modules' forwards and losses, the identity at step 0, a planted bias
learnt back, seeding, task independence, the correction installed on a real tiny CLIPModel (compared to
the representation corrected by hand), the save → load round trip and the checks before work."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import CLIPModel, CLIPVisionModel

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.post_merging.representation import representation_point, representations
from hf_featcal.post_merging.surgery import (
    DEFAULT_STEPS,
    ProbSurgeryModule,
    SurgeryModule,
    calibration_batches,
    fit_surgery,
    train_module,
)
from hf_featcal.post_merging.task_modules import CONFIG_NAME, WEIGHTS_NAME, TaskModules
from hf_featcal.saving import MANIFEST_NAME, atomic_folder, read_manifest
from testing_utils import (
    perturbed,
    pixel_batches,
    randomise_norms,
    record_prepared_batches,
    tiny_clip_config,
    tiny_vision_config,
)

TASKS = ("cars", "dtd")


def clip_setting(seed: int = 0):
    """A tiny CLIPModel base, two experts differing in every tensor, their average and pixel batches."""
    generator = torch.Generator().manual_seed(seed)
    base = CLIPModel(tiny_clip_config()).eval()
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.1).eval() for t in TASKS}
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, value in merged.state_dict().items():
            if value.is_floating_point():
                value.copy_(sum(e.state_dict()[name] for e in experts.values()) / len(experts))
    data = {t: pixel_batches(generator, [16, 8]) for t in TASKS}
    return merged, experts, data


def surgery_reference(z, down, up):
    """ẑ = z − U·ReLU(D·z), one vector (the last dimension) at a time."""
    rows = z.reshape(-1, z.shape[-1])
    return torch.stack([row - up @ torch.clamp(down @ row, min=0) for row in rows]).reshape(z.shape)


# ---------------------------------------------------------------------------- the modules
def test_surgery_forward_and_loss_match_the_formula():
    torch.manual_seed(1)
    module = SurgeryModule(6, rank=3).double()
    with torch.no_grad():
        module.up.weight.normal_()  # non-zero U: the module is no longer the identity
    z, target = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    down, up = module.down.weight.detach(), module.up.weight.detach()
    expected = surgery_reference(z, down, up)
    torch.testing.assert_close(module(z), expected, rtol=1e-12, atol=1e-12)
    pairs = zip(expected.flatten(), target.flatten(), strict=True)
    expected_loss = sum(abs(float(a) - float(b)) for a, b in pairs) / z.numel()
    assert math.isclose(float(module.training_loss(z, target).detach()), expected_loss, rel_tol=1e-12)
    assert module.down.bias is None and module.up.bias is None


def test_prob_surgery_forward_and_loss_match_the_formula():
    torch.manual_seed(2)
    module = ProbSurgeryModule(6, hidden=4, kl_weight=0.3).double()
    with torch.no_grad():
        module.mean.weight.normal_()
        module.log_variance.weight.normal_(std=0.3)
    z, target = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    a, m, v = (layer.weight.detach() for layer in (module.encode, module.mean, module.log_variance))
    s = torch.clamp(z @ a.T, min=0)
    mu, log_var = s @ m.T, s @ v.T
    # inference: subtract μ only
    torch.testing.assert_close(module(z), z - mu, rtol=1e-12, atol=1e-12)
    # training: one reparameterised sample μ + ε·σ, ε drawn from the generator given
    epsilon = torch.randn(mu.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    sample = mu + epsilon * torch.sqrt(torch.exp(log_var))
    l1 = (z - sample - target).abs().mean()
    normal = torch.distributions.Normal
    kl = torch.distributions.kl_divergence(normal(mu, torch.exp(log_var / 2)), normal(0.0, 1.0)).sum(-1).mean()
    got = module.training_loss(z, target, torch.Generator().manual_seed(7))
    assert math.isclose(float(got.detach()), float(l1 + 0.3 * kl), rel_tol=1e-12)


def test_both_start_as_the_identity_with_torch_default_init():
    z = torch.randn(7, 8)
    surgery, prob = SurgeryModule(8), ProbSurgeryModule(8)
    assert torch.equal(surgery(z), z)
    mu, log_var = prob.distribution(z)
    assert torch.equal(mu, torch.zeros_like(mu)) and torch.equal(log_var, torch.zeros_like(log_var))
    assert torch.equal(prob(z), z)
    # D and A: torch's default Linear init, U(-1/√in, 1/√in), not zero
    for weight in (surgery.down.weight.detach(), prob.encode.weight.detach()):
        assert float(weight.abs().max()) <= 1 / math.sqrt(8) and float(weight.abs().min()) > 0
    assert surgery.down.weight.shape == (16, 8) and prob.encode.weight.shape == (128, 8)


@pytest.mark.parametrize("method", ["surgery", "prob_surgery"])
def test_a_planted_bias_is_learnt(method):
    generator = torch.Generator().manual_seed(3)
    dim, rank = 8, 4
    down = torch.randn(rank, dim, generator=generator)
    up = 0.5 * torch.randn(dim, rank, generator=generator)
    z = torch.randn(256, dim, generator=generator)
    target = surgery_reference(z.double(), down.double(), up.double()).float()  # z_expert = z − U*·ReLU(D*·z)
    torch.manual_seed(0)
    module = SurgeryModule(dim, rank) if method == "surgery" else ProbSurgeryModule(dim, hidden=32)
    start = float((module(z) - target).abs().mean())
    losses = train_module(module, z, target, steps=400, lr=1e-2, batch_size=32, seed=0)
    end = float((module(z) - target).abs().mean())  # inference output (ProbSurgery: z − μ)
    assert len(losses) == 400
    assert end < 0.15 * start, (start, end)


def test_train_module_moves_only_its_module_and_refuses_non_finite_losses():
    torch.manual_seed(0)
    modules = TaskModules("surgery", TASKS, representation_point(CLIPModel(tiny_clip_config())))
    other = {k: v.clone() for k, v in modules.module_for("dtd").state_dict().items()}
    z = torch.randn(20, 8)
    train_module(modules.module_for("cars"), z, z + 1, steps=20)
    assert all(torch.equal(v, modules.module_for("dtd").state_dict()[k]) for k, v in other.items())
    assert float(modules.module_for("cars").up.weight.abs().sum()) > 0
    broken = SurgeryModule(8)
    with pytest.raises(ValueError, match="non-finite"):
        train_module(broken, z, torch.full_like(z, float("nan")), steps=3)
    assert all(bool(torch.isfinite(p).all()) for p in broken.parameters())


# ---------------------------------------------------------------------------- fit_surgery
def test_fit_surgery_is_seeded_and_each_task_trains_on_its_own():
    merged, experts, data = clip_setting()
    first = fit_surgery(merged, experts, data, steps=30)
    again = fit_surgery(merged, experts, data, steps=30)
    other_seed = fit_surgery(merged, experts, data, steps=30, seed=1)
    alone = fit_surgery(merged, {"dtd": experts["dtd"]}, {"dtd": data["dtd"]}, steps=30)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert not torch.equal(first.corrections[0].down.weight, other_seed.corrections[0].down.weight)
    # dtd's module is the same whether cars was trained before it or not: no other task's training moves it
    for key, value in alone.module_for("dtd").state_dict().items():
        assert torch.equal(value, first.module_for("dtd").state_dict()[key]), key
    assert first.training_settings["steps"] == 30 and DEFAULT_STEPS == {"surgery": 1000, "prob_surgery": 5000}


def test_fit_surgery_brings_the_representation_towards_the_expert():
    merged, experts, data = clip_setting()
    for method in ("surgery", "prob_surgery"):
        modules = fit_surgery(merged, experts, data, method=method, steps=300, lr=1e-2)
        for task in TASKS:
            z = representations(merged, data[task])
            target = representations(experts[task], data[task])
            before = float((z - target).abs().mean())
            after = float((modules(z, task) - target).abs().mean())
            assert after < 0.6 * before, (method, task, before, after)


def test_a_bare_tower_expert_is_read_through_the_merged_projection():
    merged, experts, data = clip_setting()
    towers, full = {}, {}
    for task, expert in experts.items():
        towers[task] = CLIPVisionModel(tiny_vision_config()).eval()
        towers[task].load_state_dict(expert.vision_model.state_dict())
        full[task] = copy.deepcopy(expert)
        full[task].visual_projection.load_state_dict(merged.visual_projection.state_dict())
    from_towers = fit_surgery(merged, towers, data, steps=20)
    from_full = fit_surgery(merged, full, data, steps=20)
    for key, value in from_full.state_dict().items():
        assert torch.equal(value, from_towers.state_dict()[key]), key
    # a full expert keeps its own projection: different targets, different modules
    own = fit_surgery(merged, experts, data, steps=20)
    assert not torch.equal(own.corrections[0].up.weight, from_full.corrections[0].up.weight)


def test_shared_prob_surgery_needs_no_task():
    merged, experts, data = clip_setting()
    modules = fit_surgery(merged, experts, data, method="prob_surgery", shared=True, steps=20, hidden=16)
    assert not modules.needs_task and len(modules.corrections) == 1
    assert modules.num_parameters() == 3 * 16 * 8
    z = torch.randn(3, 8)
    assert torch.equal(modules(z), modules(z, "cars"))
    per_task = fit_surgery(merged, experts, data, method="prob_surgery", steps=20, hidden=16)
    assert per_task.needs_task and per_task.num_parameters() == 2 * 3 * 16 * 8
    with pytest.raises(ValueError, match="task"):
        per_task(z)


def test_calibration_data_is_drawn_as_featcal_draws_it(generator, monkeypatch):
    from datasets import Dataset

    merged, experts, _ = clip_setting()
    rows = {t: Dataset.from_dict({"pixel_values": torch.randn(40, 3, 8, 8, generator=generator).numpy()})
            .with_format("torch") for t in TASKS}
    ours = calibration_batches(merged, rows, num_samples_per_task=24)
    featcal = record_prepared_batches(monkeypatch)
    FeatCalCalibrator(merged, None, experts, rows, FeatCalConfig(num_samples_per_task=24), show_progress=False)
    for task in TASKS:
        assert [len(b["pixel_values"]) for b in ours[task]] == [16, 8]
        for a, b in zip(ours[task], featcal[task], strict=True):
            assert torch.equal(a["pixel_values"], b["pixel_values"])
    other = calibration_batches(merged, rows, num_samples_per_task=24, data_seed=1)
    assert not torch.equal(other["cars"][0]["pixel_values"], ours["cars"][0]["pixel_values"])
    modules = fit_surgery(merged, experts, rows, num_samples_per_task=24, steps=3)
    assert modules.training_settings["rows_per_task"] == {"cars": 24, "dtd": 24}


# ---------------------------------------------------------------------------- applying and saving
def test_for_task_changes_image_features_by_the_correction_and_leaves_no_hook():
    merged, experts, data = clip_setting()
    modules = fit_surgery(merged, experts, data, steps=50, lr=1e-2)
    merged, modules = merged.double(), modules.double()
    pixels = data["cars"][0]["pixel_values"].double()
    with torch.no_grad():
        plain = merged.get_image_features(pixel_values=pixels).pooler_output
        module = modules.module_for("cars")
        expected = surgery_reference(plain, module.down.weight, module.up.weight)
        with modules.for_task(merged, "cars"):
            corrected = merged.get_image_features(pixel_values=pixels).pooler_output
        after = merged.get_image_features(pixel_values=pixels).pooler_output
        assert float((expected - plain).abs().max()) > 1e-3  # the correction is not the identity
        torch.testing.assert_close(corrected, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(after, plain)
        assert not merged.visual_projection._forward_hooks
        with pytest.raises(RuntimeError, match="inside"), modules.for_task(merged, "dtd"):
            raise RuntimeError("inside the block")
        assert not merged.visual_projection._forward_hooks
        assert torch.equal(merged.get_image_features(pixel_values=pixels).pooler_output, plain)


@pytest.mark.parametrize("method, shared", [("surgery", False), ("prob_surgery", False), ("prob_surgery", True)])
def test_save_and_load_give_the_same_outputs(tmp_path, method, shared):
    merged, experts, data = clip_setting()
    modules = fit_surgery(merged, experts, data, method=method, shared=shared, steps=20, hidden=16)
    paths = modules.save_pretrained(tmp_path)
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == sorted([WEIGHTS_NAME, CONFIG_NAME])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([WEIGHTS_NAME, CONFIG_NAME])  # no temporary left
    loaded = TaskModules.from_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["method"] == method and config["tasks"] == list(TASKS) and config["needs_task"] is not shared
    assert config["num_parameters"] == modules.num_parameters() == loaded.num_parameters()
    assert loaded.point == modules.point and loaded.shared == shared
    pixels = data["dtd"][1]["pixel_values"]
    with torch.no_grad():
        for task in TASKS:
            with modules.for_task(merged, task):
                before = merged.get_image_features(pixel_values=pixels).pooler_output
            with loaded.for_task(merged, task):
                after = merged.get_image_features(pixel_values=pixels).pooler_output
            assert torch.equal(before, after)


def test_a_model_save_with_modules_lists_them_in_its_manifest(tmp_path):
    merged, experts, data = clip_setting()
    modules = fit_surgery(merged, experts, data, steps=5)
    with atomic_folder(tmp_path / "out") as folder:
        merged.save_pretrained(folder)
        modules.save_pretrained(folder)
    listed = read_manifest(tmp_path / "out")
    assert listed is not None and {WEIGHTS_NAME, CONFIG_NAME, MANIFEST_NAME} <= set(listed)
    assert torch.equal(TaskModules.from_pretrained(tmp_path / "out").corrections[1].up.weight,
                       modules.corrections[1].up.weight)


# ---------------------------------------------------------------------------- checks before work
@pytest.mark.parametrize("change, match", [
    (dict(method="lora"), "`method`"),
    (dict(rank=0), "`rank`"),
    (dict(hidden=1.5), "`hidden`"),
    (dict(steps=0), "`steps`"),
    (dict(lr=0.0), "`lr`"),
    (dict(lr=float("nan")), "`lr`"),
    (dict(batch_size=True), "`batch_size`"),
    (dict(kl_weight=-1.0), "`kl_weight`"),
    (dict(shared="yes"), "`shared`"),
    (dict(seed=-1), "`seed`"),
    (dict(num_samples_per_task=0), "`num_samples_per_task`"),
    (dict(data_seed="a"), "`data_seed`"),
    (dict(device="gpu-please"), "`device`"),
])
def test_bad_arguments_are_refused_before_any_forward(change, match):
    merged, experts, data = clip_setting()
    forwards = []
    for model in (merged, *experts.values()):
        model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=match):
        fit_surgery(merged, experts, data, **change)
    assert not forwards


def test_bad_models_and_data_are_refused_before_any_forward():
    merged, experts, data = clip_setting()
    forwards = []
    for model in (merged, *experts.values()):
        model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match="no entry in `calibration_data`"):
        fit_surgery(merged, experts, {"cars": data["cars"]})
    other = CLIPModel(tiny_clip_config(hidden_size=24)).eval()
    with pytest.raises(ValueError, match=r"experts\['dtd'\]"):
        fit_surgery(merged, {**experts, "dtd": other}, data)
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\]"):
        fit_surgery(merged, experts, {**data, "cars": [{"pixels": torch.zeros(2, 3, 8, 8)}]})
    with pytest.raises(TypeError, match="`merged`"):
        fit_surgery("merged", experts, data)
    with pytest.raises(ValueError, match="no known representation point"):
        fit_surgery(torch.nn.Linear(2, 2), experts, data)
    assert not forwards


def test_every_forward_a_layer_map_may_name_is_implemented_and_others_are_refused():
    """A layer map's `representation_point` names its forward from `REPRESENTATION_FORWARDS`; each has a
    runner here, and a saved point naming another is refused when read back."""
    from hf_featcal.architectures import REPRESENTATION_FORWARDS, RepresentationPoint
    from hf_featcal.post_merging.representation import ARCHITECTURES

    assert set(ARCHITECTURES) == set(REPRESENTATION_FORWARDS)
    saved = representation_point(CLIPModel(tiny_clip_config())).to_dict()
    assert RepresentationPoint.from_dict(saved) == representation_point(CLIPModel(tiny_clip_config()))
    for change in ({"architecture": "resnet"}, {"selection": "mean"}):
        with pytest.raises(ValueError, match="unknown representation point"):
            RepresentationPoint.from_dict({**saved, **change})


def test_module_init_follows_the_seed_not_the_global_random_state():
    point = representation_point(CLIPModel(tiny_clip_config()))
    torch.manual_seed(5)
    first = TaskModules("surgery", TASKS, point, seed=0)
    state = torch.random.get_rng_state()
    torch.manual_seed(6)
    second = TaskModules("surgery", TASKS, point, seed=0)
    torch.manual_seed(6)
    other = TaskModules("surgery", TASKS, point, seed=1)
    assert torch.equal(first.corrections[0].down.weight, second.corrections[0].down.weight)
    assert not torch.equal(first.corrections[0].down.weight, first.corrections[1].down.weight)  # per task
    assert not torch.equal(first.corrections[0].down.weight, other.corrections[0].down.weight)
    torch.manual_seed(5)
    TaskModules("surgery", TASKS, point, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is left as it was


# ---------------------------------------------------------------------------- other architectures
def test_clip_towers_with_and_without_projection(generator):
    from transformers import CLIPVisionModelWithProjection

    pixels = {"pixel_values": torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)}
    tower = CLIPVisionModel(tiny_vision_config()).eval().double()
    point = representation_point(tower)
    assert (point.module, point.dim) == ("post_layernorm", 16)
    torch.testing.assert_close(representations(tower, [pixels]), tower(**pixels).pooler_output.float())
    projected = CLIPVisionModelWithProjection(tiny_clip_config().vision_config).eval().double()
    point = representation_point(projected)
    assert point.module == "visual_projection"
    torch.testing.assert_close(representations(projected, [pixels]), projected(**pixels).image_embeds.float())
    # modules trained on one representation are refused on a model that reads another
    modules = _trained(representation_point(CLIPModel(tiny_clip_config())))
    with pytest.raises(ValueError, match="`model`"), modules.for_task(tower, "a"):
        pass
    assert not tower.post_layernorm._forward_hooks


def test_apply_corrects_a_tensor_and_still_applies_a_function_to_submodules():
    modules = _trained(representation_point(CLIPModel(tiny_clip_config())))
    z = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(modules.apply(z, "a"), modules(z, "a"))
    seen = []
    assert modules.apply(lambda m: seen.append(type(m).__name__)) is modules
    assert seen.count("Linear") == 2 and seen[-1] == "TaskModules"


def _text(generator, labels: bool = False):
    ids = torch.randint(2, 40, (3, 7), generator=generator)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 4:] = 0  # padding
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels:
        target = torch.randint(2, 40, (3, 5), generator=generator)
        target[1, 3:] = -100
        batch["labels"] = target
    return batch


def _check_for_task(model, modules, task, run, read, selected):
    """Under `for_task`, the representation (`read` of the output of `run`) becomes the module's correction
    of it, computed by hand in float64 on the selected rows; the rest of the output is unchanged."""
    with torch.no_grad():
        plain = read(run())
        with modules.for_task(model, task):
            corrected = read(run())
        module = modules.module_for(task)
        expected = plain.clone()
        expected[selected] = surgery_reference(plain[selected], module.down.weight, module.up.weight)
        torch.testing.assert_close(corrected, expected, rtol=1e-10, atol=1e-10)
        assert float((expected - plain).abs().max()) > 1e-4


def _trained(point, dtype=torch.float64):
    torch.manual_seed(0)
    modules = TaskModules("surgery", ["a"], point).to(dtype)
    with torch.no_grad():
        modules.module_for("a").up.weight.normal_()
    return modules


def test_bert_and_vit_read_the_pooled_token_of_the_last_hidden_state(generator):
    from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

    bert = BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3)).eval().double()
    batch = _text(generator)
    point = representation_point(bert)
    assert (point.module, point.selection, point.token_index) == ("bert.encoder.layer.1", "token", 0)
    hidden = bert(**batch, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(representations(bert, [batch]), hidden[:, 0].float())
    _check_for_task(bert, _trained(point), "a", lambda: bert.bert(**batch).last_hidden_state, lambda h: h,
                    (slice(None), 0))

    vit = ViTForImageClassification(ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_labels=3)).eval().double()
    pixels = {"pixel_values": torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)}
    point = representation_point(vit)
    assert (point.module, point.selection, point.token_index) == ("vit.layernorm", "token", 0)
    torch.testing.assert_close(representations(vit, [pixels]), vit.vit(**pixels).last_hidden_state[:, 0].float())
    _check_for_task(vit, _trained(point), "a", lambda: vit.vit(**pixels).last_hidden_state, lambda h: h,
                    (slice(None), 0))


def test_t5_and_llama_read_the_last_hidden_state_at_the_weighted_positions(generator):
    from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu")).eval().double()
    batch = _text(generator, labels=True)
    point = representation_point(t5)
    assert (point.module, point.selection) == ("decoder.final_layer_norm", "positions")
    hidden = t5(**batch, output_hidden_states=True).decoder_hidden_states[-1]
    weighted = batch["labels"] != -100
    torch.testing.assert_close(representations(t5, [batch]), hidden[weighted].float())
    assert len(representations(t5, [batch])) == int(weighted.sum()) == 13
    # at inference every decoder position is corrected (the module acts on one vector at a time)
    _check_for_task(t5, _trained(point), "a", lambda: t5(**batch, output_hidden_states=True),
                    lambda out: out.decoder_hidden_states[-1], (slice(None), slice(None)))

    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0)).eval().double()
    batch = _text(generator)
    point = representation_point(llama)
    assert (point.module, point.selection) == ("model.norm", "positions")
    hidden = llama(**batch, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(representations(llama, [batch]), hidden[batch["attention_mask"] > 0].float())
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(7) < 3, -100)  # only the answer positions
    counted = (batch["attention_mask"] > 0) & (batch["labels"] != -100)
    torch.testing.assert_close(representations(llama, [batch]), hidden[counted].float())


def test_open_clip_reads_the_image_tower_before_normalisation(generator):
    pytest.importorskip("open_clip")
    from openclip_models import tiny_clip, tiny_tower

    for model in (tiny_clip().double(), tiny_tower().double()):
        pixels = {"pixel_values": torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)}
        point = representation_point(model)
        assert point.dim == 8 and point.module == ("visual" if hasattr(model, "visual") else "")
        encode = getattr(model, "encode_image", model)
        torch.testing.assert_close(representations(model, [pixels]), encode(pixels["pixel_values"]).float())
        _check_for_task(model, _trained(point), "a", lambda m=encode, p=pixels: m(p["pixel_values"]),
                        lambda z: z, (slice(None),))


# ---------------------------------------------------------------------------- experts from folders
def test_folder_and_lora_experts_give_the_modules_of_the_same_experts_in_memory(tmp_path):
    from peft import LoraConfig, get_peft_model

    merged, experts, data = clip_setting()
    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / task)
    from_folders = fit_surgery(merged, {t: str(tmp_path / t) for t in TASKS}, data, steps=10)
    in_memory = fit_surgery(merged, experts, data, steps=10)
    for key, value in in_memory.state_dict().items():
        torch.testing.assert_close(from_folders.state_dict()[key], value, rtol=1e-5, atol=1e-7)

    # LoRA adapters on the vision tower of a CLIPModel base: read as the base with the adapter merged in
    tower = CLIPVisionModel(tiny_vision_config()).eval()
    tower.load_state_dict(merged.vision_model.state_dict())
    full = {}
    for seed, task in enumerate(TASKS):
        torch.manual_seed(seed)
        adapted = get_peft_model(copy.deepcopy(tower), LoraConfig(r=2, target_modules=["q_proj", "fc1"],
                                                                  init_lora_weights=False))
        adapted.save_pretrained(tmp_path / f"lora-{task}")
        full[task] = copy.deepcopy(adapted).merge_and_unload().eval()
    with pytest.raises(ValueError, match="base_model"):
        fit_surgery(merged, {t: str(tmp_path / f"lora-{t}") for t in TASKS}, data, steps=10)
    from_adapters = fit_surgery(merged, {t: str(tmp_path / f"lora-{t}") for t in TASKS}, data, steps=10,
                                base_model=tower)
    from_full = fit_surgery(merged, full, data, steps=10)
    for key, value in from_full.state_dict().items():
        torch.testing.assert_close(from_adapters.state_dict()[key], value, rtol=1e-5, atol=1e-7)


def test_fit_surgery_leaves_the_merged_model_and_its_mode_as_they_were():
    merged, experts, data = clip_setting()
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    merged.train()
    experts["cars"].train()
    fit_surgery(merged, experts, data, steps=3)
    assert merged.training and all(m.training for m in merged.modules())
    assert experts["cars"].training and not experts["dtd"].training
    assert all(torch.equal(v, state[k]) for k, v in merged.state_dict().items())
    assert not merged.visual_projection._forward_hooks and not merged.visual_projection._forward_pre_hooks


def test_from_pretrained_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        TaskModules.from_pretrained(tmp_path)
    merged, experts, data = clip_setting()
    fit_surgery(merged, experts, data, steps=3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "format": 99}))
    with pytest.raises(ValueError, match="format"):
        TaskModules.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "hyper_parameters": {"rank": 4}}))
    with pytest.raises(RuntimeError, match="size mismatch"):
        TaskModules.from_pretrained(tmp_path)


def test_fit_surgery_on_t5_trains_on_the_target_positions(generator):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                      decoder_start_token_id=0, feed_forward_proj="gated-gelu")
    torch.manual_seed(0)
    merged = T5ForConditionalGeneration(config).eval()
    experts = {t: perturbed(merged, generator, 0.2).eval() for t in TASKS}
    data = {t: [_text(generator, labels=True), _text(generator, labels=True)] for t in TASKS}
    modules = fit_surgery(merged, experts, data, steps=200, lr=1e-2)
    assert modules.training_settings["rows_per_task"] == {"cars": 26, "dtd": 26}  # labels ≠ -100, two batches
    z = representations(merged, data["cars"])
    target = representations(experts["cars"], data["cars"])
    with torch.no_grad():
        assert float((modules(z, "cars") - target).abs().mean()) < 0.8 * float((z - target).abs().mean())
    with modules.for_task(merged, "cars"):
        generated = merged.generate(data["cars"][0]["input_ids"], max_new_tokens=3, do_sample=False)
    assert generated.shape[0] == 3 and not merged.decoder.final_layer_norm._forward_hooks


def test_fit_surgery_on_an_open_clip_tower_with_clip_experts(generator):
    pytest.importorskip("open_clip")
    from openclip_models import tiny_clip, tiny_tower

    torch.manual_seed(0)
    experts = {t: tiny_clip() for t in TASKS}
    merged = tiny_tower()
    merged.load_state_dict(experts["cars"].visual.state_dict())
    data = {t: pixel_batches(generator, [6]) for t in TASKS}
    modules = fit_surgery(merged, experts, data, steps=5)
    assert modules.point.module == "" and modules.num_parameters() == 2 * 2 * 16 * 8
    # the cars expert's tower is the merged model: its representation is the merged one exactly, the L1
    # gradient at ẑ = z is zero and its U stays zero; dtd's moves
    assert torch.equal(modules.module_for("cars").up.weight, torch.zeros(8, 16))
    assert float(modules.module_for("dtd").up.weight.detach().abs().max()) > 0
