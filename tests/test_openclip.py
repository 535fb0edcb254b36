"""open_clip vision towers (`VisionTransformer`, alone or inside an open_clip `CLIP`).

The independent check: an open_clip tower converted to a transformers `CLIPVisionModel` (packed
in-projection split into q/k/v) computes the same features, so the naive float64 reference
implementation of the spec (`reference_featcal`, written for transformers CLIP) calibrates the
converted models; the library's open_clip result, converted the same way, must agree with it.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

if os.environ.get("HF_FEATCAL_REQUIRE_OPTIONAL") == "1":
    import open_clip  # CI installs the [open_clip] extra: these tests must run there
else:
    open_clip = pytest.importorskip("open_clip")
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from transformers import CLIPVisionModel

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from openclip_models import (
    HEADS,
    IMAGE,
    LAYERS,
    MLP,
    PATCH,
    WIDTH,
    open_clip_setting,
    register_tiny_model_config,
    tiny_tower,
    write_open_clip_recipe_world,
)
from reference_featcal import reference_featcal
from test_reference_agreement import check_steps_from_the_merged_model
from testing_utils import assert_same_up_to_rounding, perturbed, randomise_norms, tiny_vision_config


def _visual(model):
    return getattr(model, "visual", model)


def to_transformers(model) -> CLIPVisionModel:
    """The same vision tower as a transformers `CLIPVisionModel` (float64)."""
    visual = _visual(model)
    hf = CLIPVisionModel(tiny_vision_config(hidden_size=WIDTH, intermediate_size=MLP, num_hidden_layers=LAYERS,
                                            num_attention_heads=HEADS, image_size=IMAGE, patch_size=PATCH))
    sd = {
        "embeddings.class_embedding": visual.class_embedding,
        "embeddings.patch_embedding.weight": visual.conv1.weight,
        "embeddings.position_embedding.weight": visual.positional_embedding,
        "pre_layrnorm.weight": visual.ln_pre.weight, "pre_layrnorm.bias": visual.ln_pre.bias,
        "post_layernorm.weight": visual.ln_post.weight, "post_layernorm.bias": visual.ln_post.bias,
    }
    for i, block in enumerate(visual.transformer.resblocks):
        p = f"encoder.layers.{i}."
        for part, w, b in zip("qkv", block.attn.in_proj_weight.chunk(3), block.attn.in_proj_bias.chunk(3), strict=True):
            sd[p + f"self_attn.{part}_proj.weight"], sd[p + f"self_attn.{part}_proj.bias"] = w, b
        pairs = {"self_attn.out_proj": block.attn.out_proj, "layer_norm1": block.ln_1, "layer_norm2": block.ln_2,
                 "mlp.fc1": block.mlp.c_fc, "mlp.fc2": block.mlp.c_proj}
        for name, module in pairs.items():
            sd[p + name + ".weight"], sd[p + name + ".bias"] = module.weight, module.bias
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
    return hf.double().eval()


def _block_outputs(model, pixels):
    """Every resblock's output of the model's own full forward (`encode_image` for a CLIP)."""
    outs = []
    handles = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in _visual(model).transformer.resblocks]
    with torch.no_grad():
        (model.encode_image if hasattr(model, "encode_image") else model)(pixels)
    for h in handles:
        h.remove()
    return outs


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    den = sum(float(b[k].double().square().sum()) for k in b)
    return (num / den) ** 0.5


def test_conversion_is_the_same_network(generator):
    model = tiny_tower()
    randomise_norms(model, generator)
    pixels = torch.randn(3, 3, IMAGE, IMAGE, generator=generator)
    hf = to_transformers(model)
    with torch.no_grad():
        want = hf(pixels.double(), output_hidden_states=True).hidden_states[1:]
    got = _block_outputs(model, pixels)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_base", [True, False])
def test_matches_the_reference_implementation(generator, with_base):
    base, experts, merged, data = open_clip_setting(generator)
    text_before = {k: v.clone() for k, v in merged.state_dict().items() if not k.startswith("visual.")}
    given = to_transformers(merged).state_dict()
    expected, expected_drift = reference_featcal(
        to_transformers(merged), to_transformers(base) if with_base else None,
        {t: to_transformers(e) for t, e in experts.items()},
        {t: [b["pixel_values"] for b in bs] for t, bs in data.items()},
    )
    calibrator = FeatCalCalibrator(merged, base if with_base else None, experts, data, show_progress=False)
    calibrated = calibrator.calibrate()
    assert calibrated is merged and type(calibrated) is CLIP
    got = to_transformers(calibrated).state_dict()
    want = expected.state_dict()
    assert _relative(got, want) < 5e-6, _relative(got, want)
    # against the merged model as given: every block tensor moved, by the reference's step; the rest is untouched
    check_steps_from_the_merged_model(given, got, want, step_tol=1e-3)
    # the query rows of the last block's packed projection were solved with class-token weights, key/value rows without
    plan = calibrator._plans[(0, LAYERS - 1)]
    assert plan.linear_groups[("attn", True, "tokens")] == ["attn.in_proj.q"]
    assert plan.linear_groups[("attn", False, "tokens")] == ["attn.in_proj.k", "attn.in_proj.v"]
    # the text tower is untouched
    for k, v in text_before.items():
        assert torch.equal(merged.state_dict()[k], v), k
    report = calibrator.report.to_dict()["tasks"]
    for task, stages in expected_drift.items():
        assert report[task]["before"] == pytest.approx(stages["before"], rel=1e-5)
        assert report[task]["after"] == pytest.approx(stages["after"], rel=1e-4)


def test_drift_before_is_the_full_models_own_forward(generator):
    base, experts, merged, data = open_clip_setting(generator)
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.calibrate()
    for task, expert in experts.items():
        sums, count = torch.zeros(LAYERS, dtype=torch.float64), 0
        for batch in data[task]:
            for i, (hm, he) in enumerate(zip(_block_outputs(given, batch["pixel_values"]),
                                             _block_outputs(expert, batch["pixel_values"]), strict=True)):
                sums[i] += (hm.double() - he.double()).norm(dim=-1).sum()
            count += hm.shape[0] * hm.shape[1]
        assert calibrator.report.tasks[task]["before"] == pytest.approx((sums / count).tolist(), rel=1e-5)


@pytest.mark.parametrize(
    "parameter, target_modules",
    [
        ("mlp.c_proj.weight", None),  # the last Linear of each block, every module calibrated
        ("attn.out_proj.weight", ["attn.out_proj"]),  # nn.MultiheadAttention never calls out_proj as a module
        ("attn.in_proj_weight", ["in_proj"]),  # the packed projection, selected by its own name
    ],
)
def test_exact_recovery(generator, parameter, target_modules):
    expert = tiny_tower().double()
    randomise_norms(expert, generator)
    merged = copy.deepcopy(expert)
    with torch.no_grad():
        for block in merged.transformer.resblocks:
            p = block.get_parameter(parameter)
            p.add_(0.3 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
    batches = [
        {"pixel_values": torch.randn(8, 3, IMAGE, IMAGE, generator=generator, dtype=torch.float64)} for _ in range(3)
    ]
    config = FeatCalConfig(teacher_alpha=1.0, lambda_ratio=0.0, compute_dtype="float64", epsilon=1e-15,
                           target_modules=target_modules)
    FeatCalCalibrator(merged, None, {"t": expert}, {"t": batches}, config, show_progress=False).calibrate()
    for bm, be in zip(merged.transformer.resblocks, expert.transformer.resblocks, strict=True):
        got, want = bm.get_parameter(parameter).detach(), be.get_parameter(parameter).detach()
        assert float((got - want).norm() / want.norm()) <= 1e-8
    probe = torch.randn(3, 3, IMAGE, IMAGE, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        got, want = merged(probe), expert(probe)
    assert float((got - want).norm() / want.norm()) <= 1e-8


def test_pool_type_decides_the_class_token_weighting(generator):
    base, experts, merged, data = open_clip_setting(generator, build=tiny_tower)
    avg = {name: copy.deepcopy(m) for name, m in [("base", base), ("merged", merged)]}
    avg_experts = {t: copy.deepcopy(e) for t, e in experts.items()}
    for model in [*avg.values(), *avg_experts.values()]:
        model.pool_type = "avg"
    calibrator = FeatCalCalibrator(avg["merged"], avg["base"], avg_experts, data, show_progress=False)
    assert all(not weighted for (_, weighted, _) in calibrator._plans[(0, LAYERS - 1)].linear_groups)
    calibrator.calibrate()
    # average pooling: the same as class-token pooling with every token at weight 1 in the last block
    tok_uniform = copy.deepcopy(merged)
    FeatCalCalibrator(tok_uniform, base, experts, data, FeatCalConfig(final_block_token_weight=1.0),
                      show_progress=False).calibrate()
    tok_default = copy.deepcopy(merged)
    FeatCalCalibrator(tok_default, base, experts, data, show_progress=False).calibrate()
    assert _relative(avg["merged"].state_dict(), tok_uniform.state_dict()) < 1e-6
    assert _relative(tok_default.state_dict(), tok_uniform.state_dict()) > 1e-4


def test_mismatched_and_unsupported_models(generator):
    base, experts, merged, data = open_clip_setting(generator, build=tiny_tower)
    wider_mlp = tiny_tower(mlp_ratio=3.0)
    with pytest.raises(ValueError, match=r"experts\['dtd'\].*mlp_width: merged 32 vs 48"):
        FeatCalCalibrator(merged, base, {"cars": experts["cars"], "dtd": wider_mlp}, data)
    more_heads = tiny_tower(heads=4)
    with pytest.raises(ValueError, match=r"base_model.*heads: merged 2 vs 4"):
        FeatCalCalibrator(merged, more_heads, experts, data)
    transformers_expert = CLIPVisionModel(tiny_vision_config())
    with pytest.raises(ValueError, match=r"experts\['dtd'\].*model_type 'clip_vision_model'.*open_clip_vision"):
        FeatCalCalibrator(merged, base, {"cars": experts["cars"], "dtd": transformers_expert}, data)
    custom = tiny_tower(scale_attn=True)  # open_clip's CustomResidualAttentionBlock
    with pytest.raises(ValueError, match="only ResidualAttentionBlock"):
        FeatCalCalibrator(custom, None, {"cars": copy.deepcopy(custom)}, {"cars": data["cars"]})
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\]"):
        FeatCalCalibrator(merged, base, experts,
                          {"cars": [{"input_ids": torch.ones(2, 3, dtype=torch.long)}], "dtd": data["dtd"]})


@pytest.fixture
def tiny_model_name(tmp_path):
    """A tiny open_clip model config registered under a name, as `open_clip.add_model_config` allows."""
    return register_tiny_model_config(tmp_path, "hf-featcal-tiny-vit")


def test_open_clip_folders_read_lazily_saved_the_open_clip_way(generator, tmp_path, tiny_model_name, monkeypatch):
    from hf_featcal.architectures.openclip import CONFIG_NAME, WEIGHTS_NAME, OpenCLIPVisionLayerMap, load_open_clip
    from hf_featcal.experts import CheckpointSource
    from hf_featcal.merging import engine as merging_engine
    from hf_featcal.merging import task_arithmetic

    base = load_open_clip(tiny_model_name)
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cars", "dtd")}
    folders = {}
    for name, model in [("base", base), *experts.items()]:
        folders[name] = str(tmp_path / name)
        OpenCLIPVisionLayerMap().save_model(model, folders[name])
    # merging reads the open_clip folders too: the experts lazily, tensor by tensor, never loaded whole
    loads = []
    real_load_model = merging_engine.load_model
    monkeypatch.setattr(merging_engine, "load_model",
                        lambda source, argument: loads.append(argument) or real_load_model(source, argument))
    merged = task_arithmetic(f"local-dir:{folders['base']}", {t: f"local-dir:{folders[t]}" for t in experts}, 0.3)
    monkeypatch.undo()
    assert loads == ["base_model"]
    assert type(merged) is CLIP
    for name, value in merged.state_dict().items():
        want = base.state_dict()[name] + 0.3 * sum(
            e.state_dict()[name] - base.state_dict()[name] for e in experts.values()
        )
        torch.testing.assert_close(value, want, rtol=0, atol=1e-6)
    data = {
        t: [{"pixel_values": torch.randn(4, 3, IMAGE, IMAGE, generator=generator)} for _ in range(2)] for t in experts
    }

    in_memory = copy.deepcopy(merged)
    FeatCalCalibrator(in_memory, base, experts, data, show_progress=False).calibrate()
    # experts and base as folders: "local-dir:" references or a plain folder holding open_clip_config.json
    calibrator = FeatCalCalibrator(
        merged, f"local-dir:{folders['base']}", {"cars": f"local-dir:{folders['cars']}", "dtd": folders["dtd"]}, data,
        show_progress=False,
    )
    assert all(isinstance(s, CheckpointSource) for s in [calibrator.base, *calibrator.experts.values()])
    calibrator.calibrate()
    assert_same_up_to_rounding(merged.state_dict(), in_memory.state_dict())

    out = tmp_path / "calibrated"
    calibrator.save_model(out)
    assert {WEIGHTS_NAME, CONFIG_NAME, "README.md"} <= set(os.listdir(out))
    # the card says which library loads the model back, and how it was merged
    card = (out / "README.md").read_text()
    assert "library_name: open_clip" in card and "method=task_arithmetic" in card and "scaling_factor=0.3" in card
    reloaded = open_clip.create_model(f"local-dir:{out}").eval()
    assert type(reloaded) is CLIP
    for name, value in merged.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    probe = torch.randn(2, 3, IMAGE, IMAGE, generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.encode_image(probe), merged.encode_image(probe))
    # a missing folder is a clear error naming the argument
    with pytest.raises(ValueError, match=r"experts\['dtd'\].*not an open_clip folder"):
        FeatCalCalibrator(merged, base, {"cars": experts["cars"], "dtd": f"local-dir:{tmp_path / 'nowhere'}"}, data)


def test_zero_shot_evaluation_of_open_clip_models(generator):
    """`evaluate_clip_zeroshot` on an open_clip CLIP (and its bare tower) agrees with open_clip's own
    zero-shot classifier (`open_clip.build_zero_shot_classifier`)."""
    import datasets
    import numpy as np
    from PIL import Image

    from hf_featcal.evaluation import evaluate_clip_zeroshot

    text = CLIPTextCfg(context_length=12, vocab_size=49408, width=16, heads=2, layers=1)
    vision = CLIPVisionCfg(layers=LAYERS, width=WIDTH, head_width=WIDTH // HEADS, mlp_ratio=2.0, patch_size=PATCH,
                           image_size=IMAGE)
    model = CLIP(embed_dim=8, vision_cfg=vision, text_cfg=text, quick_gelu=True).eval()
    randomise_norms(model, generator)
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=12)
    preprocess = open_clip.image_transform(IMAGE, is_train=False)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)) for _ in range(24)]
    labels = [i % 3 for i in range(24)]
    dataset = datasets.Dataset.from_dict({"image": images, "label": labels})
    names, templates = ["cat", "dog", "bird"], ["a photo of a {c}.", "a drawing of a {c}."]

    with torch.no_grad():
        classifier = open_clip.build_zero_shot_classifier(
            model, tokenizer, names, [lambda c, t=t: t.format(c=c) for t in templates], device="cpu", use_tqdm=False)
        features = model.encode_image(torch.stack([preprocess(im) for im in images]))
        predictions = (torch.nn.functional.normalize(features, dim=-1) @ classifier).argmax(dim=-1)
    expected = float((predictions == torch.tensor(labels)).float().mean())

    kwargs = dict(tasks="toy", datasets={"toy": dataset}, class_names={"toy": names}, templates={"toy": templates})
    result = evaluate_clip_zeroshot(model, None, (tokenizer, preprocess), **kwargs)
    assert result["toy"] == pytest.approx(expected)
    assert result.predictions["toy"] == predictions.tolist()
    assert len(set(predictions.tolist())) > 1  # a non-trivial check: the classifier separates the images
    tower = evaluate_clip_zeroshot(model.visual, model, (tokenizer, preprocess), **kwargs)
    assert tower.predictions["toy"] == predictions.tolist()


def test_open_clip_recipe_with_surgery_saves_the_modules_the_way_open_clip_loads_the_model(
        generator, tmp_path, tiny_model_name, capsys):
    """`post_merging: surgery` on open_clip folders: the save is open_clip's (the merge, unchanged) with the
    per-task modules beside it, and each task's reported score is the reloaded model's with its module."""
    import datasets
    import yaml

    from hf_featcal import cli
    from hf_featcal.evaluation import evaluate_clip_zeroshot
    from hf_featcal.merging import task_arithmetic
    from hf_featcal.post_merging.task_modules import TaskModules

    names = {"zorbs": ["red", "green", "blue"], "glyphs": ["cat", "dog"]}
    path = write_open_clip_recipe_world(tmp_path, generator, tiny_model_name, names, {"train": 12, "test": 8},
                                        featcal_batch_size=4, num_examples=8)
    recipe = yaml.safe_load(path.read_text())
    recipe["post_merging"] = {"surgery": {"steps": 20, "lr": 0.1}}
    path.write_text(yaml.safe_dump(recipe))
    assert cli.main(["run", str(path), "--quiet"]) == 0
    assert "task_arithmetic (scaling_factor=0.3) + surgery" in capsys.readouterr().out

    out = tmp_path / "out"
    reloaded = open_clip.create_model(f"local-dir:{out}").eval()
    merged = task_arithmetic(f"local-dir:{tmp_path / 'base'}",
                             {t: f"local-dir:{tmp_path / 'experts' / t}" for t in names}, 0.3)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in merged.state_dict().items())
    modules = TaskModules.from_pretrained(out)
    evaluation = json.loads((out / "featcal_evaluation.json").read_text())
    pixels = torch.rand(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        plain = reloaded.encode_image(pixels)
        with modules.for_task(reloaded, "zorbs"):
            assert not torch.allclose(reloaded.encode_image(pixels), plain)  # the module changes the features
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    preprocess = open_clip.image_transform(IMAGE, is_train=False)
    for task in names:
        test = datasets.load_from_disk(str(tmp_path / "data" / task))["test"]
        with modules.for_task(reloaded, task):
            direct = evaluate_clip_zeroshot(reloaded, None, (tokenizer, preprocess), tasks=task,
                                            datasets={task: test}, class_names={task: names[task]})
        assert evaluation["after"][task] == pytest.approx(direct[task])


def test_open_clip_recipe_and_commands_end_to_end(generator, tmp_path, tiny_model_name, capsys):
    """`hf-featcal run` with `model_family: open_clip` (base and experts as open_clip folders, local
    datasets), then `merge` / `calibrate` / `evaluate` on the same folders."""
    import datasets
    from huggingface_hub import ModelCard

    from hf_featcal import cli
    from hf_featcal.evaluation import evaluate_clip_zeroshot
    from hf_featcal.merging import task_arithmetic

    names = {"zorbs": ["red", "green", "blue"], "glyphs": ["cat", "dog"]}
    path = write_open_clip_recipe_world(tmp_path, generator, tiny_model_name, names, {"train": 12, "test": 8},
                                        featcal_batch_size=4, num_examples=8)
    assert cli.main(["run", str(path), "--quiet"]) == 0
    assert "task_arithmetic (scaling_factor=0.3) + FeatCal" in capsys.readouterr().out

    out = tmp_path / "out"
    reloaded = open_clip.create_model(f"local-dir:{out}").eval()
    assert type(reloaded) is CLIP
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "open_clip" and card.data.featcal["merge"]["method"] == "task_arithmetic"
    assert "## Evaluation" in card.text
    # the reported "after" score is the saved model's zero-shot accuracy, recomputed here
    evaluation = json.loads((out / "featcal_evaluation.json").read_text())
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    preprocess = open_clip.image_transform(IMAGE, is_train=False)
    test = datasets.load_from_disk(str(tmp_path / "data" / "zorbs"))["test"]
    direct = evaluate_clip_zeroshot(reloaded, None, (tokenizer, preprocess), tasks="zorbs", datasets={"zorbs": test},
                                    class_names={"zorbs": names["zorbs"]})
    assert evaluation["after"]["zorbs"] == pytest.approx(direct["zorbs"])
    # the calibration changed the vision tower and only that
    merged = task_arithmetic(f"local-dir:{tmp_path / 'base'}",
                             {t: f"local-dir:{tmp_path / 'experts' / t}" for t in names}, 0.3)
    key = "visual.transformer.resblocks.1.mlp.c_proj.weight"
    assert not torch.equal(reloaded.state_dict()[key], merged.state_dict()[key])
    assert torch.equal(reloaded.state_dict()["text_projection"], merged.state_dict()["text_projection"])

    # the separate commands on the same folders
    experts = [arg for task in names for arg in ("--expert", f"{task}=local-dir:{tmp_path / 'experts' / task}")]
    assert cli.main(["merge", "--base", f"local-dir:{tmp_path / 'base'}", *experts, "--method", "task_arithmetic",
                     "--scaling-factor", "0.3", "--output-dir", str(tmp_path / "merged")]) == 0
    data = [arg for task in names for arg in ("--data", f"{task}={tmp_path / 'data' / task}")]
    assert cli.main(["calibrate", "--model", f"local-dir:{tmp_path / 'merged'}", "--base",
                     f"local-dir:{tmp_path / 'base'}",
                     *experts, *data, "--num-examples", "8", "--batch-size", "4", "--quiet",
                     "--output-dir", str(tmp_path / "calibrated")]) == 0
    calibrated = open_clip.create_model(f"local-dir:{tmp_path / 'calibrated'}")
    assert_same_up_to_rounding(calibrated.state_dict(), reloaded.state_dict())
    scores = tmp_path / "scores.json"
    assert cli.main(["evaluate", "--model", f"local-dir:{tmp_path / 'calibrated'}", "--task", "zorbs",
                     "--data", f"zorbs={tmp_path / 'data' / 'zorbs'}", "--class-names", "zorbs=red,green,blue",
                     "--batch-size", "4", "--output-json", str(scores)]) == 0
    assert json.loads(scores.read_text())["scores"]["zorbs"] == pytest.approx(direct["zorbs"])
