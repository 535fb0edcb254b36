"""Tests for the CLIP zero-shot evaluation (hf_featcal.evaluation.clip_zeroshot), fully offline.

A tiny random-init ``CLIPModel`` from configs, a word-level tokenizer built in code over the words
of the test prompts, a tiny ``CLIPImageProcessor`` and images drawn in code.
"""

from __future__ import annotations

import json

# core dependencies (install_requires / the test extra): a broken install fails here, it is never skipped
import datasets
import numpy as np
import PIL.Image as PIL_Image
import pytest
import torch
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    PreTrainedTokenizerFast,
)

from hf_featcal.evaluation import (
    CLIP_CLASS_NAMES,
    CLIP_DATASETS,
    CLIP_EXPERT_IDS,
    CLIP_NUM_CLASSES,
    CLIP_TASKS,
    CLIP_TEMPLATES,
    ClipZeroShotResults,
    build_zeroshot_head,
    evaluate_clip_zeroshot,
    load_clip_split,
    render_prompts,
    resolve_clip_task,
    vision_tower_into_clip,
)
from hf_featcal.evaluation import clip_templates as T

torch.set_num_threads(1)

# ------------------------------------------------------------------- fixtures

COLORS = ["red", "green", "blue", "yellow"]
COLOR_TEMPLATES = ["a photo of a {c} thing.", "a {c} square!", lambda c: f"the color {c}"]
SHAPES = ["circle", "square", "triangle"]
SHAPE_TEMPLATES = ["a drawing of a {c}.", "a {c} shape."]
IMAGE_SIZE = 8
N_IMAGES = 12


def _vocab() -> dict[str, int]:
    words = " ".join(
        [*COLORS, *SHAPES, "a photo of a thing square the color drawing shape number", ". ! : \""]
        + [str(d) for d in range(10)]
    ).split()
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    return vocab


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(_vocab(), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 0), ("<eos>", 1)]
    )
    # As in CLIP, the pad token is the EOS token.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def processor(tokenizer) -> CLIPProcessor:
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _vision_config(hidden: int = 16) -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=4,
        num_channels=3,
        initializer_factor=3.0,  # larger random weights: images get distinguishable embeddings
    )


def _clip_config(vision_hidden: int = 16) -> CLIPConfig:
    text = dict(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=len(_vocab()),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        max_position_embeddings=32,
        initializer_factor=3.0,
    )
    return CLIPConfig(
        text_config=text, vision_config=_vision_config(vision_hidden).to_dict(), projection_dim=8
    )


@pytest.fixture(scope="module")
def clip() -> CLIPModel:
    torch.manual_seed(1234)
    model = CLIPModel(_clip_config()).eval()
    with torch.no_grad():
        model.logit_scale.fill_(1.5)  # exp(1.5) ~ 4.48, not the default init value
    return model


def _images(seed: int = 0, n: int = N_IMAGES) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 4 == 3:  # grayscale images must be converted to RGB
            out.append(PIL_Image.fromarray(rng.integers(0, 256, (11, 9), dtype=np.uint8), mode="L"))
        else:
            out.append(PIL_Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8), mode="RGB"))
    return out


def _dataset(labels: list[int], images: list | None = None, **extra) -> datasets.Dataset:
    images = images if images is not None else _images()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    data = {"image": images, "label": labels}
    if extra:
        data.update(extra)
        for key, value in extra.items():
            features[key] = datasets.Value("string") if isinstance(value[0], str) else datasets.Value("int64")
    return datasets.Dataset.from_dict(data, features=features)


# --------------------------------------------------------- independent reference


def _tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _reference_class_embeddings(model: CLIPModel, tokenizer, class_names, templates) -> torch.Tensor:
    """One prompt at a time (no padding): normalise, average over templates, renormalise."""
    rows = []
    with torch.no_grad():
        for name in class_names:
            embs = []
            for template in templates:
                prompt = template.format(c=name) if isinstance(template, str) else template(name)
                enc = tokenizer(prompt, return_tensors="pt")
                e = _tensor(model.get_text_features(input_ids=enc["input_ids"]))[0]
                embs.append(e / e.norm())
            mean = torch.stack(embs).mean(dim=0)
            rows.append(mean / mean.norm())
    return torch.stack(rows)


def _reference_logits(model: CLIPModel, processor, images, class_embeddings) -> torch.Tensor:
    pixel_values = processor.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")[
        "pixel_values"
    ]
    with torch.no_grad():
        feats = _tensor(model.get_image_features(pixel_values=pixel_values))
    feats = feats / feats.norm(dim=-1, keepdim=True)
    return model.logit_scale.exp() * feats @ class_embeddings.T


@pytest.fixture(scope="module")
def reference(clip, tokenizer, processor) -> dict:
    images = _images()
    emb = _reference_class_embeddings(clip, tokenizer, COLORS, COLOR_TEMPLATES)
    logits = _reference_logits(clip, processor, images, emb)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "near-tie in the reference logits: choose another seed"
    pred = logits.argmax(dim=-1).tolist()
    assert len(set(pred)) > 1, "the random model predicts a single class: choose another seed"
    # 7 of 12 labels agree with the reference prediction: expected accuracy 7/12.
    labels = [p if i < 7 else (p + 1) % len(COLORS) for i, p in enumerate(pred)]
    return {"images": images, "emb": emb, "logits": logits, "pred": pred, "labels": labels}


def _evaluate(vision_model, clip_model, processor, dataset, **kwargs) -> ClipZeroShotResults:
    kwargs.setdefault("batch_size", 5)
    kwargs.setdefault("class_names", {"colors": COLORS})
    kwargs.setdefault("templates", {"colors": COLOR_TEMPLATES})
    return evaluate_clip_zeroshot(
        vision_model, clip_model, processor, ["colors"], datasets={"colors": dataset}, **kwargs
    )


# ------------------------------------------------------------------ data tables


def test_tables_cover_the_eight_tasks_with_known_class_counts():
    assert CLIP_TASKS == ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")
    expected = {
        "sun397": 397, "stanford-cars": 196, "resisc45": 45, "eurosat": 10,
        "svhn": 10, "gtsrb": 43, "mnist": 10, "dtd": 47,
    }  # fmt: skip
    assert {t: len(CLIP_CLASS_NAMES[t]) for t in CLIP_TASKS} == expected
    assert CLIP_NUM_CLASSES == expected
    n_templates = {t: len(CLIP_TEMPLATES[t]) for t in CLIP_TASKS}
    assert n_templates == {
        "sun397": 2, "stanford-cars": 8, "resisc45": 18, "eurosat": 3,
        "svhn": 1, "gtsrb": 3, "mnist": 1, "dtd": 8,
    }  # fmt: skip
    for task in CLIP_TASKS:
        names = CLIP_CLASS_NAMES[task]
        assert len(set(names)) == len(names), task
        assert all(isinstance(n, str) and n for n in names)
        assert all(t.count("{c}") == 1 for t in CLIP_TEMPLATES[task]), task
    assert set(CLIP_DATASETS) == set(CLIP_TASKS) == set(CLIP_EXPERT_IDS)
    assert CLIP_DATASETS["svhn"] == ("ufldl-stanford/svhn", "cropped_digits")
    assert CLIP_DATASETS["mnist"] == ("ylecun/mnist", None)
    assert CLIP_DATASETS["stanford-cars"] == ("tanganke/stanford_cars", None)
    assert CLIP_EXPERT_IDS["stanford-cars"] == "tanganke/clip-vit-base-patch32_stanford-cars"
    assert all(T.CLIP_IMAGE_COLUMNS[t] == "image" and T.CLIP_LABEL_COLUMNS[t] == "label" for t in CLIP_TASKS)


def test_tables_spot_check_verbatim_fusionbench_entries():
    c = CLIP_CLASS_NAMES
    assert c["mnist"] == c["svhn"] == tuple(str(d) for d in range(10))
    assert (c["sun397"][0], c["sun397"][-1]) == ("abbey", "youth hostel")
    assert "kindergarden classroom" in c["sun397"]  # the upstream spelling is kept
    assert c["stanford-cars"][0] == "AM General Hummer SUV 2000"
    assert c["stanford-cars"][-1] == "smart fortwo Convertible 2012"
    assert (c["resisc45"][0], c["resisc45"][-1]) == ("airplane", "wetland")
    assert c["eurosat"][:3] == ("annual crop land", "forest", "brushland or shrubland")
    assert c["gtsrb"][0] == "red and white circle 20 kph speed limit"
    assert "red circle with white horizonal stripe no entry" in c["gtsrb"]
    assert (c["dtd"][0], c["dtd"][-1]) == ("banded", "zigzagged")
    assert CLIP_TEMPLATES["mnist"] == ('a photo of the number: "{c}".',)
    assert CLIP_TEMPLATES["gtsrb"][0] == 'a zoomed in photo of a "{c}" traffic sign.'
    assert CLIP_TEMPLATES["stanford-cars"][3] == "i love my {c}!"
    assert CLIP_TEMPLATES["eurosat"][0] == "a centered satellite photo of {c}."
    assert CLIP_TEMPLATES["dtd"][-1] == "a photo of the {c} object."
    assert "8241e1bb1d323707a284474973a54ab7820502fa" in (T.__doc__ or "")


def test_render_prompts_and_resolve_task():
    prompts = render_prompts(["3"], CLIP_TEMPLATES["svhn"])
    assert prompts == [['a photo of the number: "3".']]
    assert render_prompts(["x", "y"], ["a {c}.", lambda c: c.upper()]) == [["a x.", "X"], ["a y.", "Y"]]
    spec = resolve_clip_task("stanford_cars")  # alias
    assert spec.name == "stanford-cars" and spec.num_classes == 196
    assert spec.dataset_path == "tanganke/stanford_cars" and spec.image_column == "image"
    custom = resolve_clip_task("colors", class_names=COLORS)
    assert custom.templates == T.CLIP_DEFAULT_TEMPLATES and custom.dataset_path is None
    overridden = resolve_clip_task("mnist", templates=["digit {c}"])
    assert overridden.class_names == CLIP_CLASS_NAMES["mnist"] and overridden.templates == ("digit {c}",)


# ----------------------------------------------------------------------- head


def test_head_is_the_template_averaged_renormalised_text_embedding(clip, tokenizer, reference):
    head = build_zeroshot_head(clip, tokenizer, COLORS, COLOR_TEMPLATES, task="colors")
    torch.testing.assert_close(head.class_embeddings, reference["emb"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.class_embeddings.norm(dim=-1), torch.ones(len(COLORS)))
    assert head.logit_scale == pytest.approx(float(np.exp(1.5)), rel=1e-6)
    torch.testing.assert_close(head.weight, head.class_embeddings * head.logit_scale)
    assert head.class_names == tuple(COLORS) and head.num_classes == len(COLORS)

    # The formula itself, from raw per-template embeddings: normalise, mean, renormalise.
    raw = []
    with torch.no_grad():
        for name in COLORS:
            for t in COLOR_TEMPLATES:
                enc = tokenizer(t.format(c=name) if isinstance(t, str) else t(name), return_tensors="pt")
                raw.append(_tensor(clip.get_text_features(input_ids=enc["input_ids"]))[0])
    raw = torch.stack(raw).reshape(len(COLORS), len(COLOR_TEMPLATES), -1)
    unit = raw / raw.norm(dim=-1, keepdim=True)
    expected = unit.mean(1) / unit.mean(1).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(head.class_embeddings, expected, atol=1e-5, rtol=1e-5)
    # ... which is not the renormalised mean of the *unnormalised* embeddings.
    naive = raw.mean(1) / raw.mean(1).norm(dim=-1, keepdim=True)
    assert not torch.allclose(naive, expected, atol=1e-4)

    # Padding / text batching does not change the head (a CLIPProcessor is accepted too).
    one_by_one = build_zeroshot_head(clip, tokenizer, COLORS, COLOR_TEMPLATES, batch_size=1)
    via_processor = build_zeroshot_head(clip, CLIPProcessor(CLIPImageProcessor(), tokenizer), COLORS, COLOR_TEMPLATES)
    torch.testing.assert_close(one_by_one.class_embeddings, head.class_embeddings, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_processor.class_embeddings, head.class_embeddings)

    # A single template: the head is the normalised prompt embedding.
    single = build_zeroshot_head(clip, tokenizer, COLORS, ["a {c} square!"])
    torch.testing.assert_close(single.class_embeddings, unit[:, 1], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- evaluation


def test_accuracy_matches_an_independent_computation(clip, processor, reference):
    ds = _dataset(reference["labels"], reference["images"])
    res = _evaluate(clip, clip, processor, ds)
    assert res.predictions["colors"] == reference["pred"]
    assert res.accuracy == {"colors": pytest.approx(7 / 12)}
    assert res.num_examples == {"colors": N_IMAGES}
    assert res.average == pytest.approx(7 / 12) and res["colors"] == pytest.approx(7 / 12)
    # The batch size does not matter; clip_model=None reuses the full CLIPModel's text tower.
    again = _evaluate(clip, None, processor, ds, batch_size=64)
    assert again.predictions == res.predictions


def test_bare_vision_tower_with_base_projection_equals_full_clip(clip, processor, reference):
    ds = _dataset(reference["labels"], reference["images"])
    bare = CLIPVisionModel(clip.config.vision_config).eval()
    bare.load_state_dict(clip.vision_model.state_dict())
    with_projection = CLIPVisionModelWithProjection(
        CLIPVisionConfig(**{**clip.config.vision_config.to_dict(), "projection_dim": clip.config.projection_dim})
    ).eval()
    with_projection.vision_model.load_state_dict(clip.vision_model.state_dict())
    with_projection.visual_projection.load_state_dict(clip.visual_projection.state_dict())

    full = _evaluate(clip, clip, processor, ds)
    for model in (bare, with_projection):
        res = _evaluate(model, clip, processor, ds)
        assert res.predictions == full.predictions
        assert res.accuracy == full.accuracy


def test_vision_tower_into_clip_round_trip(clip, processor, reference):
    torch.manual_seed(7)
    tower = CLIPVisionModel(clip.config.vision_config).eval()  # a different (e.g. calibrated) tower
    merged = vision_tower_into_clip(clip, tower)
    assert merged is not clip
    assert not torch.equal(tower.embeddings.patch_embedding.weight, clip.vision_model.embeddings.patch_embedding.weight)
    for name, value in tower.state_dict().items():
        torch.testing.assert_close(merged.vision_model.state_dict()[name], value, rtol=0, atol=0)
    for name, value in clip.state_dict().items():
        if not name.startswith("vision_model."):
            torch.testing.assert_close(merged.state_dict()[name], value, rtol=0, atol=0)

    ds = _dataset(reference["labels"], reference["images"])
    direct = _evaluate(tower, clip, processor, ds)
    via_merged = _evaluate(merged, merged, processor, ds)
    assert direct.predictions == via_merged.predictions

    # A CLIPModel as the source: its tower *and* projection are taken.
    torch.manual_seed(8)
    other = CLIPModel(clip.config).eval()
    merged2 = vision_tower_into_clip(clip, other)
    torch.testing.assert_close(merged2.visual_projection.weight, other.visual_projection.weight, rtol=0, atol=0)
    torch.testing.assert_close(merged2.text_projection.weight, clip.text_projection.weight, rtol=0, atol=0)

    with pytest.raises(ValueError, match="does not match"):
        vision_tower_into_clip(clip, CLIPVisionModel(_vision_config(hidden=24)))


def test_builtin_task_with_local_dataset_path_and_datasetdict(clip, tokenizer, processor, tmp_path):
    images = _images(seed=3, n=6)
    labels = [0, 1, 2, 3, 4, 5]
    ds = _dataset(labels, images)
    path = tmp_path / "mnist"
    datasets.DatasetDict({"test": ds, "train": ds.select([0])}).save_to_disk(str(path))

    emb = _reference_class_embeddings(clip, tokenizer, CLIP_CLASS_NAMES["mnist"], CLIP_TEMPLATES["mnist"])
    pred = _reference_logits(clip, processor, images, emb).argmax(dim=-1).tolist()
    expected = sum(p == lab for p, lab in zip(pred, labels, strict=True)) / len(labels)

    res = evaluate_clip_zeroshot(clip, clip, processor, "mnist", datasets={"mnist": str(path)}, batch_size=4)
    assert res.tasks == ["mnist"] and res.predictions["mnist"] == pred
    assert res.accuracy["mnist"] == pytest.approx(expected)
    # a (tokenizer, image_processor) pair, an alias key, max_samples and another split
    res2 = evaluate_clip_zeroshot(
        clip, clip, (tokenizer, processor.image_processor), ["mnist"],
        datasets={"mnist": datasets.load_from_disk(str(path))}, max_samples=4,
    )  # fmt: skip
    assert res2.predictions["mnist"] == pred[:4] and res2.num_examples == {"mnist": 4}
    res3 = evaluate_clip_zeroshot(clip, clip, processor, "mnist", datasets={"mnist": str(path)}, split="train")
    assert res3.num_examples == {"mnist": 1}


def test_two_tasks_results_dict_and_markdown(clip, processor, reference):
    colors = _dataset(reference["labels"], reference["images"])
    shapes = _dataset([i % 3 for i in range(N_IMAGES)])
    res = evaluate_clip_zeroshot(
        clip,
        clip,
        processor,
        ["colors", "shapes"],
        datasets={"colors": colors, "shapes": shapes},
        class_names={"colors": COLORS, "shapes": SHAPES},
        templates={"colors": COLOR_TEMPLATES, "shapes": SHAPE_TEMPLATES},
        batch_size=8,
        num_workers=1,
    )
    assert res.tasks == ["colors", "shapes"]
    assert res.accuracy["colors"] == pytest.approx(7 / 12)
    assert res.average == pytest.approx((res.accuracy["colors"] + res.accuracy["shapes"]) / 2)
    d = res.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d) == {"accuracy", "average", "num_examples"}
    assert "predictions" in res.to_dict(include_predictions=True)
    md = res.to_markdown()
    assert "| colors | 58.33 | 12 |" in md and "**Average**" in md
    wide = res.to_markdown(wide=True, percent=False, digits=3)
    assert wide.splitlines()[0] == "| colors | shapes | Avg. |"
    assert wide.splitlines()[2].startswith("| 0.583 |")


# ---------------------------------------------------------------------- errors


def test_errors_name_the_argument(clip, tokenizer, processor, reference, tmp_path):
    ds = _dataset(reference["labels"], reference["images"])

    with pytest.raises(ValueError, match=r"tasks: unknown CLIP task 'cifar10'.*sun397.*dtd"):
        evaluate_clip_zeroshot(clip, clip, processor, ["cifar10"], datasets={})
    with pytest.raises(ValueError, match="datasets: custom task 'colors'"):
        evaluate_clip_zeroshot(clip, clip, processor, ["colors"], class_names={"colors": COLORS})
    with pytest.raises(ValueError, match="class_names has an entry for 'shapes'"):
        _evaluate(clip, clip, processor, ds, class_names={"colors": COLORS, "shapes": SHAPES})
    with pytest.raises(ValueError, match="datasets has an entry for 'shapes'"):
        evaluate_clip_zeroshot(
            clip, clip, processor, ["colors"], datasets={"colors": ds, "shapes": ds}, class_names={"colors": COLORS}
        )
    with pytest.raises(ValueError, match="templates .*lacks the class-name placeholder"):
        _evaluate(clip, clip, processor, ds, templates={"colors": ["a photo"]})
    with pytest.raises(ValueError, match="class_names .*at least 2"):
        evaluate_clip_zeroshot(clip, clip, processor, ["x"], datasets={"x": ds}, class_names={"x": ["only"]})
    with pytest.raises(ValueError, match="lists .*more than once"):
        evaluate_clip_zeroshot(clip, clip, processor, ["mnist", "mnist"])
    with pytest.raises(ValueError, match="tasks is empty"):
        evaluate_clip_zeroshot(clip, clip, processor, [])

    with pytest.raises(ValueError, match="image_column 'image'"):
        _evaluate(clip, clip, processor, ds.rename_column("image", "img"))
    with pytest.raises(ValueError, match="label_column 'label'"):
        _evaluate(clip, clip, processor, ds.rename_column("label", "y"))
    with pytest.raises(ValueError, match=r"labels must be integers in \[0, 4\)"):
        _evaluate(clip, clip, processor, _dataset([0] * 11 + [4], reference["images"]))
    labelled = ds.cast_column("label", datasets.ClassLabel(names=["a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match="5 classes .* class_names has 4"):
        _evaluate(clip, clip, processor, labelled)
    with pytest.raises(ValueError, match="is empty"):
        _evaluate(clip, clip, processor, ds.select([]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _evaluate(clip, clip, processor, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="split='validation'"):
        _evaluate(clip, clip, processor, datasets.DatasetDict({"test": ds}), split="validation")

    with pytest.raises(ValueError, match="batch_size"):
        _evaluate(clip, clip, processor, ds, batch_size=0)
    with pytest.raises(ValueError, match="max_samples"):
        _evaluate(clip, clip, processor, ds, max_samples=0)
    with pytest.raises(ValueError, match="processor"):
        _evaluate(clip, clip, tokenizer, ds)
    with pytest.raises(ValueError, match="clip_model is required"):
        _evaluate(CLIPVisionModel(clip.config.vision_config), None, processor, ds)
    with pytest.raises(ValueError, match="hidden size 24"):
        _evaluate(CLIPVisionModel(_vision_config(hidden=24)), clip, processor, ds)
    with pytest.raises(TypeError, match="vision_model must be"):
        _evaluate(torch.nn.Linear(2, 2), clip, processor, ds)
    with pytest.raises(ValueError, match="custom task 'colors' has no Hub dataset"):
        load_clip_split(resolve_clip_task("colors", class_names=COLORS))


def test_models_are_left_in_their_mode(clip, processor, reference):
    ds = _dataset(reference["labels"], reference["images"])
    tower = CLIPVisionModel(clip.config.vision_config).train()
    _evaluate(tower, clip, processor, ds)
    assert tower.training and not clip.training
