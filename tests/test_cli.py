"""The `hf-featcal` command line and YAML recipes, offline: tiny local CLIP models and datasets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from hf_featcal import cli, recipes
from hf_featcal.recipes import RecipeError, load_recipe

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "examples", "recipes")
TASKS = {"zorbs": ["zorb", "blip", "quax"], "glyphs": ["glyph", "wisp"]}  # made-up tasks and class names
IMAGE_SIZE = 8


# ============================================================================ the tiny world
def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    for word in "a photo of the drawing . ".split() + [n for names in TASKS.values() for n in names]:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 0), ("<eos>", 1)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<eos>", unk_token="<unk>"), len(vocab)


def _images(rng: np.random.Generator, n: int, task_index: int) -> list[Image.Image]:
    out = []
    for _ in range(n):
        pixels = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
        pixels[..., task_index] //= 3  # each task its own colour cast
        out.append(Image.fromarray(pixels))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """base/ (CLIPModel + processor), experts/<task>/ (CLIPVisionModel), data/<task>/ (DatasetDict
    train/test with PIL images and labels), all written with save_pretrained / save_to_disk."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPVisionModel

    root = tmp_path_factory.mktemp("world")
    tokenizer, vocab_size = _tokenizer()
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=4, num_channels=3)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=vocab_size,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=16)
    base = CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=8)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial LayerNorm affines (random init has γ=1, β=0)
        for module in base.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
                module.bias.add_(0.2 * torch.randn(module.bias.shape, generator=generator))
    base.save_pretrained(root / "base")
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(root / "base")

    rng = np.random.default_rng(0)
    for index, (task, names) in enumerate(TASKS.items()):
        expert = CLIPVisionModel(base.config.vision_config).eval()
        expert.load_state_dict(base.vision_model.state_dict())
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        expert.save_pretrained(root / "experts" / task)
        splits = {}
        for split, n in (("train", 24), ("test", 10)):
            features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
            splits[split] = datasets.Dataset.from_dict(
                {"image": _images(rng, n, index), "label": [i % len(names) for i in range(n)]}, features=features
            )
        datasets.DatasetDict(splits).save_to_disk(str(root / "data" / task))
    return root


def _recipe(world, **changes) -> dict:
    """A valid recipe on the tiny world (relative paths: resolved against the recipe's folder)."""
    recipe = {
        "model_family": "clip",
        "base": "./base",
        "experts": {task: f"./experts/{task}" for task in TASKS},
        "merge": {"method": "task_arithmetic", "scaling_factor": 0.3},
        "featcal": {"lambda_ratio": 0.05, "batch_size": 8},
        "calibration": {
            "default": {"dataset": "./data/{task}", "split": "train", "num_examples": 16},
        },
        "evaluation": {
            "split": "test",
            "batch_size": 8,
            "class_names": {task: names for task, names in TASKS.items()},
            "templates": {"glyphs": ["a drawing of a {c} .", "a photo of the {c} ."]},
        },
        "output_dir": str(world / "out"),
        "push_to_hub": None,
    }
    for key, value in changes.items():
        recipe[key] = value
    return recipe


def _write(path, recipe: dict) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    return str(path)


# ===================================================================================== run
def test_run_recipe_end_to_end(world, capsys):
    from huggingface_hub import ModelCard
    from transformers import CLIPModel, CLIPProcessor

    from hf_featcal.merging import merge_models

    path = _write(world / "recipe.yaml", _recipe(world))
    assert cli.main(["run", path, "--quiet"]) == 0
    captured = capsys.readouterr()
    out_dir = world / "out"
    # the tables: before / after per task, and the drift summary
    assert "task_arithmetic (scaling_factor=0.3) + FeatCal" in captured.out
    assert "| zorbs | glyphs | mean |" in captured.out
    assert "last block before" in captured.out

    model = CLIPModel.from_pretrained(out_dir)
    assert model.config.hf_featcal_merge["method"] == "task_arithmetic"
    CLIPProcessor.from_pretrained(out_dir)  # the processor travels with the model

    card = ModelCard.load(out_dir / "README.md")
    assert card.data.base_model is None and "local folder `base`" in card.text  # no hub id: named in the text only
    assert card.data.featcal["tasks"] == list(TASKS)
    assert card.data.featcal["merge"]["method"] == "task_arithmetic"
    assert card.data.featcal["samples_per_task"] == {task: 16 for task in TASKS}
    assert "## Evaluation" in card.text and "![feature drift per block](featcal_drift.png)" in card.text

    with open(out_dir / "featcal_drift.png", "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    evaluation = json.loads((out_dir / "featcal_evaluation.json").read_text())
    assert set(evaluation["before"]) == set(evaluation["after"]) == set(TASKS)
    assert all(0.0 <= v <= 1.0 for v in evaluation["after"].values())
    # the saved recipe is resolved: it validates to the same recipe from anywhere
    saved = load_recipe(out_dir / "featcal_recipe.yaml")
    original = load_recipe(path)
    assert saved.calibration == original.calibration and saved.evaluation == original.evaluation
    assert (saved.base, saved.experts, saved.merge, saved.featcal) == (original.base, original.experts, original.merge,
                                                                       original.featcal)
    drift = json.loads((out_dir / "featcal_drift_report.json").read_text())["tasks"]
    assert all(sum(d["after"]) < sum(d["before"]) for d in drift.values())

    # calibration changed the merged vision tower (and only what FeatCal writes)
    merged = merge_models(str(world / "base"), {t: str(world / "experts" / t) for t in TASKS}, "task_arithmetic",
                          scaling_factor=0.3)
    fc2 = "vision_model.encoder.layers.1.mlp.fc2.weight"
    assert not torch.equal(model.state_dict()[fc2], merged.state_dict()[fc2])
    text = "text_model.encoder.layers.0.mlp.fc1.weight"
    assert torch.equal(model.state_dict()[text], merged.state_dict()[text])

    # the saved model evaluates with `hf-featcal evaluate` (custom task: local data + class names)
    scores = world / "scores.json"
    assert cli.main(["evaluate", "--model", str(out_dir), "--task", "zorbs", "--data",
                     f"zorbs={world / 'data' / 'zorbs'}",
                     "--class-names", "zorbs=zorb,blip,quax", "--batch-size", "8", "--output-json", str(scores)]) == 0
    assert json.loads(scores.read_text())["scores"]["zorbs"] == pytest.approx(evaluation["after"]["zorbs"])
    assert "| zorbs | mean |" in capsys.readouterr().out


def _hub_stand_in(monkeypatch) -> dict:
    """The hub cannot be reached here: `testing_utils.hub_stand_in` (a token set, no repository yet)."""
    from testing_utils import hub_stand_in

    return hub_stand_in(monkeypatch)


def test_a_run_without_a_drift_report_links_no_drift_plot(world, capsys):
    out_dir = world / "out-no-drift"
    path = _write(world / "no-drift.yaml", _recipe(world, featcal={"batch_size": 8, "report_drift": False},
                                                   output_dir=str(out_dir)))
    assert cli.main(["run", path, "--quiet"]) == 0
    card = (out_dir / "README.md").read_text()
    assert "## Evaluation" in card and "+ FeatCal" in card
    assert not (out_dir / "featcal_drift.png").exists() and "featcal_drift.png" not in card


def test_run_pushes_exactly_the_files_of_the_save(world, monkeypatch, capsys):
    """The output folder also holds the user's `.env`, a private subfolder and notes: the run refuses
    it unless --overwrite, then pushes only the files of this save (the manifest's), with no local path
    in them, to a repo created private with --private; the user's files stay untouched."""
    from hf_featcal.saving import read_manifest

    calls = _hub_stand_in(monkeypatch)
    out = world / "pushed"
    (out / "private").mkdir(parents=True)
    (out / ".env").write_text("HF_TOKEN=hf_secret\n")
    (out / "private" / "notes.txt").write_text("secret plans")
    path = _write(world / "push.yaml", _recipe(world, evaluation=False, output_dir=str(out)))

    assert cli.main(["run", path, "--quiet", "--push-to-hub", "me/tiny-featcal"]) == 2
    err = capsys.readouterr().err
    assert "output_dir: " in err and "is not an earlier hf_featcal save" in err and "it holds: .env, private" in err
    assert "Loading" not in err and calls["upload_folder"] == []  # refused before any work

    assert cli.main(["run", path, "--quiet", "--push-to-hub", "me/tiny-featcal", "--private", "--overwrite"]) == 0
    assert "Pushed to https://huggingface.co/me/tiny-featcal" in capsys.readouterr().out
    assert calls["create_repo"] == [("me/tiny-featcal", {"private": True, "exist_ok": True})]
    (repo, files, kwargs), = calls["upload_folder"]
    assert repo == "me/tiny-featcal"
    assert sorted(files) == sorted(read_manifest(out))
    assert {"README.md", "config.json", "model.safetensors", "featcal_drift.png", "featcal_recipe.yaml"} <= set(files)
    assert not [name for name in files if name.startswith((".env", "private"))]
    for name, content in files.items():
        assert str(world).encode() not in content, f"{name} publishes a local path"
    pushed_recipe = yaml.safe_load(files["featcal_recipe.yaml"])
    assert pushed_recipe["base"] == "<local>/base" and pushed_recipe["output_dir"] == "<local>/pushed"
    assert yaml.safe_load((out / "featcal_recipe.yaml").read_text())["base"] == str(world / "base")  # kept locally
    assert (out / ".env").read_text() == "HF_TOKEN=hf_secret\n" and (out / "private" / "notes.txt").exists()
    assert not [name for name in os.listdir(out) if name.startswith(".featcal-")]

    assert cli.main(["run", path, "--quiet", "--push-to-hub", "me/tiny-featcal", "--no-push"]) == 0
    assert len(calls["upload_folder"]) == 1


def test_an_output_folder_the_run_reads_is_refused_before_any_work(world, capsys):
    """merge / calibrate / run into (or inside) one of their inputs: exit 2 naming the option or key,
    before anything is loaded; the input is untouched."""
    experts = [arg for task in TASKS for arg in ("--expert", f"{task}={world / 'experts' / task}")]
    data = [arg for task in TASKS for arg in ("--data", f"{task}={world / 'data' / task}")]
    before = sorted(os.listdir(world / "base"))
    assert cli.main(["merge", "--base", str(world / "base"), *experts, "--output-dir", str(world / "base")]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir: {str(world / 'base')!r} is the folder of `--base`" in err and "Merging" not in err
    assert cli.main(["calibrate", "--model", str(world / "base"), *experts, *data, "--quiet",
                     "--output-dir", str(world / "experts" / "zorbs" / "calibrated")]) == 2
    err = capsys.readouterr().err
    assert "lies inside the folder of `--expert zorbs`" in err and "Loading" not in err
    path = _write(world / "into-data.yaml", _recipe(world, output_dir=str(world / "data")))
    assert cli.main(["run", path, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        "output_dir: " in err
        and "contains the folder of `calibration.tasks.zorbs.dataset`" in err
        and "Loading" not in err
    )
    with pytest.raises(RecipeError, match="contains the folder of"):
        recipes.run_recipe(load_recipe(path), log=lambda message: None)
    assert sorted(os.listdir(world / "base")) == before
    assert not os.path.exists(world / "experts" / "zorbs" / "calibrated")


def test_merge_then_calibrate_commands(world, capsys):
    from huggingface_hub import ModelCard
    from transformers import CLIPModel

    experts = [arg for task in TASKS for arg in ("--expert", f"{task}={world / 'experts' / task}")]
    merged_dir = world / "merged-ties"
    assert cli.main(["merge", "--base", str(world / "base"), *experts, "--method", "ties", "--scaling-factor", "0.5",
                     "--density", "0.5", "--output-dir", str(merged_dir)]) == 0
    merged = CLIPModel.from_pretrained(merged_dir)
    assert merged.config.hf_featcal_merge["method"] == "ties"
    assert merged.config.hf_featcal_merge["density"] == 0.5
    assert os.path.isfile(merged_dir / "processor_config.json") or os.path.isfile(
        merged_dir / "preprocessor_config.json"
    )

    data = [arg for task in TASKS for arg in ("--data", f"{task}={world / 'data' / task}")]
    out = world / "calibrated"
    assert cli.main(["calibrate", "--model", str(merged_dir), "--base", str(world / "base"), *experts, *data,
                     "--num-examples", "16", "--teacher-alpha", "0.3", "--batch-size", "8", "--quiet",
                     "--output-dir", str(out)]) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.featcal["merge"]["method"] == "ties"
    assert card.data.featcal["config"]["teacher_alpha"] == 0.3
    assert os.path.isfile(out / "featcal_drift.png")
    assert "last block before" in capsys.readouterr().out

    # option errors name the option and stop before loading anything
    code = cli.main(["merge", "--base", str(world / "base"), *experts, "--method", "task_arithmetic", "--density",
                     "0.5", "--output-dir", str(world / "never")])
    assert code == 2 and "--density" in capsys.readouterr().err
    assert not os.path.exists(world / "never")


def test_run_flan_t5_recipe_end_to_end(tmp_path, capsys):
    """FLAN-T5 family: GLUE prompt preprocessing for calibration, GLUE scoring on validation."""
    from huggingface_hub import ModelCard
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    from hf_featcal.evaluation.glue import GLUE_LABEL_WORDS, GLUE_PROMPT_TEMPLATES

    rows = {
        "cola": {"sentence": ["the cat sat", "cat the sat", "a dog runs", "runs dog a", "the sun is warm",
                              "warm is sun"]},
        "rte": {"sentence1": ["the cat sat", "a dog runs", "the sun is warm", "a man eats", "the cat sat",
                              "a dog runs"],
                "sentence2": ["a cat sat", "the dog sleeps", "the sun is hot", "a man is hungry", "a dog runs",
                              "a cat sat"]},
    }
    pre = pre_tokenizers.Whitespace()
    texts = [GLUE_PROMPT_TEMPLATES[t] for t in rows] + [w for t in rows for w in GLUE_LABEL_WORDS[t]]
    texts += [s for columns in rows.values() for column in columns.values() for s in column]
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in sorted({piece for text in texts for piece, _ in pre.pre_tokenize_str(text)}):
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")

    torch.manual_seed(0)
    config = T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=1,
                      num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    base = T5ForConditionalGeneration(config).eval()
    base.save_pretrained(tmp_path / "t5-base")
    tokenizer.save_pretrained(tmp_path / "t5-base")
    generator = torch.Generator().manual_seed(1)
    for task, columns in rows.items():
        expert = T5ForConditionalGeneration(config).eval()
        expert.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        expert.save_pretrained(tmp_path / "experts" / task)
        labels = [i % 2 for i in range(6)]
        split = {"train": datasets.Dataset.from_dict({**columns, "label": labels, "idx": list(range(6))}),
                 "validation": datasets.Dataset.from_dict({**columns, "label": labels[::-1], "idx": list(range(6))})}
        datasets.DatasetDict(split).save_to_disk(str(tmp_path / "glue" / task))

    recipe = {
        "model_family": "flan_t5",
        "base": "./t5-base",
        "experts": {"cola": "./experts/cola", "rte": "./experts/rte"},
        "merge": {"method": "dare", "scaling_factor": 0.3, "drop_rate": 0.5, "seed": 3},
        "featcal": {"batch_size": 4},
        "calibration": {"default": {"dataset": "./glue/{task}", "num_examples": 6, "max_input_length": 64}},
        "evaluation": {"batch_size": 4, "max_samples": 4},  # default split: validation
        "output_dir": str(tmp_path / "t5-out"),
    }
    path = _write(tmp_path / "t5.yaml", recipe)
    assert cli.main(["run", path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "GLUE headline score (%), split validation" in out and "| cola | rte | mean |" in out
    card = ModelCard.load(tmp_path / "t5-out" / "README.md")
    assert card.data.featcal["merge"]["method"] == "dare"
    assert card.data.featcal["samples_per_task"] == {"cola": 6, "rte": 6}
    T5ForConditionalGeneration.from_pretrained(tmp_path / "t5-out")
    AutoTokenizer.from_pretrained(tmp_path / "t5-out")
    evaluation = json.loads((tmp_path / "t5-out" / "featcal_evaluation.json").read_text())
    assert evaluation["details"]["after"]["cola"]["num_examples"] == {"cola": 4}
    assert os.path.isfile(tmp_path / "t5-out" / "featcal_drift.png")

    # the same recipe with Surgery in place of FeatCal: T5 saved with its per-task modules, each task's
    # reported score the reloaded model's, generating inside that task's module
    import dataclasses as dc

    from hf_featcal.post_merging.task_modules import TaskModules
    from hf_featcal.recipes import evaluate_model, prepare_recipe_inputs

    recipe.update(post_merging={"surgery": {"steps": 5}}, output_dir=str(tmp_path / "t5-surgery"))
    path = _write(tmp_path / "t5-surgery.yaml", recipe)
    assert cli.main(["run", path, "--quiet"]) == 0
    assert "dare (scaling_factor=0.3, drop_rate=0.5, seed=3) + surgery" in capsys.readouterr().out
    model = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5-surgery").eval()
    modules = TaskModules.from_pretrained(tmp_path / "t5-surgery")
    evaluation = json.loads((tmp_path / "t5-surgery" / "featcal_evaluation.json").read_text())
    loaded = load_recipe(path)
    inputs = prepare_recipe_inputs(loaded, evaluate=True, log=lambda message: None)
    for task in ("cola", "rte"):
        with modules.for_task(model, task):
            scores, _ = evaluate_model("flan_t5", model, dc.replace(loaded.evaluation, tasks=[task]),
                                       processing=inputs.processing)
        assert scores[task] == pytest.approx(evaluation["after"][task])


# ============================================================== another post-merging step
def _re_score(world, recipe_path, model, modules=None) -> dict:
    """The recipe's evaluation of `model` (loaded back from a save), task by task, inside each task's
    module where `modules` is given."""
    import dataclasses as dc

    from hf_featcal.recipes import evaluate_model, prepare_recipe_inputs

    recipe = load_recipe(recipe_path)
    inputs = prepare_recipe_inputs(recipe, evaluate=True, log=lambda message: None)
    scores = {}
    for task in recipe.evaluation.tasks:
        with modules.for_task(model, task) if modules is not None else contextlib.nullcontext():
            scores[task] = evaluate_model("clip", model, dc.replace(recipe.evaluation, tasks=[task]),
                                          processing=inputs.processing, clip_model=inputs.clip_model)[0][task]
    return scores


def test_a_recipe_runs_another_post_merging_step_and_saves_its_modules(world, capsys):
    """post_merging: surgery runs Surgery on the merge in place of FeatCal: the save holds the merged
    model (unchanged, as Surgery leaves it) and the per-task modules; the scores after equal the saved
    model's own, re-scored with each task's module loaded back from the folder."""
    from transformers import CLIPModel

    from hf_featcal.merging import merge_models
    from hf_featcal.post_merging.task_modules import TaskModules

    out_dir = world / "out-surgery"
    path = _write(world / "surgery.yaml", _recipe(world, post_merging={"surgery": {"steps": 20, "lr": 0.1}},
                                                  output_dir=str(out_dir)))
    assert cli.main(["run", path, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "post-merging surgery" in out and "task_arithmetic (scaling_factor=0.3) + surgery" in out
    assert "per-task modules" in out and "drift report" not in out

    model = CLIPModel.from_pretrained(out_dir).eval()
    modules = TaskModules.from_pretrained(out_dir)
    assert modules.tasks == list(TASKS) and modules.needs_task
    merged = merge_models(str(world / "base"), {t: str(world / "experts" / t) for t in TASKS}, "task_arithmetic",
                          scaling_factor=0.3)
    saved = model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in merged.state_dict().items())
    card = (out_dir / "README.md").read_text()
    assert "**Task needed at inference:** yes" in card and "before and after surgery" in card
    assert not (out_dir / "featcal_drift.png").exists() and "featcal_drift.png" not in card

    evaluation = json.loads((out_dir / "featcal_evaluation.json").read_text())
    assert evaluation["after"] != evaluation["before"]  # in this seeded world the modules move a task's score
    assert _re_score(world, path, model, modules) == pytest.approx(evaluation["after"])
    assert _re_score(world, path, model) == pytest.approx(evaluation["before"])  # the merge, without modules
    pixels = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE)

    def features() -> torch.Tensor:  # transformers 5 wraps them in an output with the projection as pooler_output
        out = model.get_image_features(pixel_values=pixels)
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    with torch.no_grad():
        plain = features()
        with modules.for_task(model, "zorbs"):
            corrected = features()
    assert not torch.allclose(plain, corrected)  # the module does change what the head reads

    again = load_recipe(out_dir / "featcal_recipe.yaml")  # the resolved recipe keeps the step and its parameters
    assert (again.post_merging, again.post_merging_parameters) == ("surgery", {"steps": 20, "lr": 0.1})

    # the modules are Surgery's from the Python API on the recipe's merge, data and parameters
    from safetensors.torch import load_file

    from hf_featcal.model_io import load_model
    from hf_featcal.post_merging import get_step
    from hf_featcal.recipes import prepare_recipe_inputs

    recipe = load_recipe(path)
    inputs = prepare_recipe_inputs(recipe, evaluate=False, log=lambda message: None)
    experts = {t: load_model(str(world / "experts" / t), t) for t in TASKS}
    direct = get_step("surgery").run(merged, inputs.base, experts, inputs.calibration, config=recipe.featcal,
                                     processing_class=recipe.family.calibration_processing_class(inputs.processing),
                                     steps=20, lr=0.1)
    direct.task_modules.save_pretrained(world / "direct-surgery")
    want = load_file(world / "direct-surgery" / "post_merging_modules.safetensors")
    got = load_file(out_dir / "post_merging_modules.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_recipe_with_a_one_model_step_saves_that_model(world, capsys):
    """post_merging: svc saves SVC's model, equal to SVC computed on the merge here; no module files."""
    from transformers import CLIPModel, CLIPVisionModel

    from hf_featcal.merging import merge_models, singular_value_calibration
    from hf_featcal.merging.svc import svc_alpha_for

    out_dir = world / "out-svc"
    path = _write(world / "svc.yaml", _recipe(world, post_merging="svc", output_dir=str(out_dir)))
    assert cli.main(["run", path, "--check"]) == 0
    checked = capsys.readouterr().out
    assert "post-merging svc" in checked and "The recipe is valid" in checked
    assert "FeatCal module selection" not in checked  # FeatCal's pre-flight is not this step's
    assert cli.main(["run", path, "--quiet"]) == 0
    assert "+ svc" in capsys.readouterr().out
    experts = {t: CLIPVisionModel.from_pretrained(world / "experts" / t) for t in TASKS}
    base = CLIPModel.from_pretrained(world / "base")
    merged = merge_models(base, experts, "task_arithmetic", scaling_factor=0.3)
    want = singular_value_calibration(merged, base, experts, alpha=svc_alpha_for("task_arithmetic")).state_dict()
    got = CLIPModel.from_pretrained(out_dir).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    fc1 = "vision_model.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(got[fc1], merged.state_dict()[fc1])  # SVC did change the merge
    assert not (out_dir / "post_merging_modules.safetensors").exists()
    card = (out_dir / "README.md").read_text()
    assert card.startswith("# task_arithmetic (scaling_factor=0.3) + svc") and "## Evaluation" in card
    evaluation = json.loads((out_dir / "featcal_evaluation.json").read_text())
    assert _re_score(world, path, CLIPModel.from_pretrained(out_dir).eval()) == pytest.approx(evaluation["after"])


def test_a_recipe_with_no_post_merging_step_saves_the_merge_scored_once(world, capsys):
    from transformers import CLIPModel

    from hf_featcal.merging import merge_models

    out_dir = world / "out-none"
    path = _write(world / "none.yaml", _recipe(world, post_merging="none", output_dir=str(out_dir)))
    assert cli.main(["run", path]) == 0
    timings = capsys.readouterr().out.split("Timings:")[1]
    assert "evaluate_before" in timings and "evaluate_after" not in timings  # the merge is the result: scored once
    merged = merge_models(str(world / "base"), {t: str(world / "experts" / t) for t in TASKS}, "task_arithmetic",
                          scaling_factor=0.3).state_dict()
    got = CLIPModel.from_pretrained(out_dir).state_dict()
    assert got.keys() == merged.keys() and all(torch.equal(got[k], merged[k]) for k in merged)
    evaluation = json.loads((out_dir / "featcal_evaluation.json").read_text())
    assert evaluation["after"] == evaluation["before"]
    assert evaluation["before"] == pytest.approx(_re_score(world, path, CLIPModel.from_pretrained(out_dir).eval()))


@pytest.mark.parametrize("step,fields", [("featcal_module", "featcal.granularity"),
                                         ("featcal_guarded", "featcal.heldout_fraction, featcal.guard")])
def test_a_featcal_variant_as_the_step_points_to_the_featcal_section(world, step, fields):
    path = _write(world / "variant.yaml", _recipe(world, post_merging={step: None}))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key == "post_merging" and f"set {fields} in the featcal section" in str(info.value)


def test_another_post_merging_step_is_refused_under_several_processes(world, tmp_path):
    """Two processes (torch.distributed.run, gloo): each refuses post_merging: surgery, naming the key,
    before anything is loaded; nothing is written."""
    from testing_utils import launch_two_processes

    out_dir = tmp_path / "never"
    path = _write(tmp_path / "two.yaml", _recipe(world, post_merging="surgery", output_dir=str(out_dir),
                                                 base=str(world / "base"),
                                                 experts={t: str(world / "experts" / t) for t in TASKS},
                                                 calibration={"default": {"dataset": str(world / "data") + "/{task}",
                                                                          "split": "train", "num_examples": 16}}))
    done = launch_two_processes("-m", "hf_featcal", "run", path, "--no-push")
    assert done.returncode != 0
    assert done.stderr.count("post_merging: 'surgery' runs in one process, this run has 2") == 2
    assert not out_dir.exists()


# ============================================================================ bad recipes
BAD = [
    ("merge.density", {"merge": {"method": "ties", "scaling_factor": 0.3, "density": 1.5}}),
    ("merge.scaling_factor", {"merge": {"method": "average", "scaling_factor": 0.3}}),
    ("merge.method", {"merge": {"method": "magic"}}),
    ("featcal.lambda_ratio", {"featcal": {"lambda_ratio": -1.0}}),
    ("featcal.lamda_ratio", {"featcal": {"lamda_ratio": 0.1}}),
    ("model_family", {"model_family": "gpt2"}),
    ("experts.zorbs", {"experts": {"zorbs": 3}}),
    ("base", {"base": "./no/such/model"}),
    ("calibration.default.num_examples", {"calibration": {"default": {"dataset": "./data/{task}", "num_examples": 0}}}),
    ("calibration.tasks.glyphs", {"calibration": {"tasks": {"zorbs": "./data/zorbs"}}}),
    ("calibration.default.glue_task", {"calibration": {"default": {"dataset": "./data/{task}", "glue_task": "cola"}}}),
    ("calibration.default.split", {"calibration": {"default": {"dataset": "./data/{task}", "split": "validation"}}}),
    ("evaluation.tasks[0]", {"evaluation": {"tasks": ["cars"]}}),
    ("evaluation.class_names.zorbs", {"evaluation": {"tasks": ["zorbs"]}}),
    ("evaluation.templates.zorbs[0]", {"evaluation": {"class_names": {"zorbs": ["a", "b", "c"], "glyphs": ["x", "y"]},
                                                      "templates": {"zorbs": ["a photo of {}"]}}}),
    ("evaluation.split",
     {"evaluation": {"split": "train", "class_names": {"zorbs": ["a", "b", "c"], "glyphs": ["x", "y"]}}}),
    ("push_to_hub", {"push_to_hub": "not a repo"}),
    ("private", {"private": "yes"}),
    ("overwrite", {"overwrite": 1}),
    ("surprise", {"surprise": 1}),
    ("post_merging", {"post_merging": "magic"}),
    ("post_merging", {"post_merging": "featcal_module"}),
    ("post_merging", {"post_merging": {"surgery": None, "svc": None}}),
    ("post_merging.surgery", {"post_merging": {"surgery": {"steps": 0}}}),
]


@pytest.mark.parametrize("key,changes", BAD, ids=[key for key, _ in BAD])
def test_bad_recipes_fail_before_any_download(world, key, changes, monkeypatch, capsys):
    def never(*args, **kwargs):  # pragma: no cover - the recipe must be refused before this
        raise AssertionError("run_recipe was called on an invalid recipe")

    monkeypatch.setattr(recipes, "run_recipe", never)
    path = _write(world / "bad.yaml", _recipe(world, **changes))
    assert cli.main(["run", path]) == 2
    err = capsys.readouterr().err
    assert f"{key}:" in err and "bad.yaml" in err
    assert "Traceback" not in err
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key == key


def test_recipe_errors_without_traceback_from_the_console_script(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent("""\
        model_family: clip
        base: openai/clip-vit-base-patch32
        experts: {mnist: tanganke/clip-vit-base-patch32_mnist}
        merge: {method: ties, density: 2}
        calibration: {tasks: {mnist: ylecun/mnist}}
        """))
    exe = shutil.which("hf-featcal") or os.path.join(os.path.dirname(sys.executable), "hf-featcal")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([exe, "run", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "merge.density: must be in (0, 1]" in result.stderr
    assert "Traceback" not in result.stderr


def test_not_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("model_family: [unclosed\n")
    assert cli.main(["run", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad.write_text("!!python/object/apply:os.system ['echo hacked']\n")  # safe_load refuses python tags
    assert cli.main(["run", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "not valid YAML" in captured.err and "hacked" not in captured.out


# ======================================================================== shipped recipes
@pytest.mark.parametrize("name", ["clip_vit_b32_ta8.yaml", "clip_vit_b32_ties8.yaml", "flan_t5_base_glue8.yaml",
                                  "clip_vit_b32_ta8_surgery.yaml"])
def test_shipped_recipes_validate(name, capsys):
    recipe = load_recipe(os.path.join(SHIPPED, name))
    assert recipe.post_merging == ("surgery" if "surgery" in name else "featcal")
    assert recipe.push_to_hub is None
    assert all(spec.split == "train" and spec.num_examples == 256 for spec in recipe.calibration.values())
    assert recipe.merge.params["scaling_factor"] == 0.3
    assert recipe.evaluation is not None and recipe.evaluation.tasks == recipe.tasks
    if recipe.model_family == "clip":
        assert recipe.base == "openai/clip-vit-base-patch32"
        assert recipe.tasks == ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
        assert all(e == f"tanganke/clip-vit-base-patch32_{t}" for t, e in recipe.experts.items())
        svhn = recipe.calibration["svhn"]
        assert (svhn.dataset, svhn.config) == ("ufldl-stanford/svhn", "cropped_digits")
        assert recipe.calibration["stanford-cars"].dataset == "tanganke/stanford_cars"
        assert recipe.calibration["mnist"].dataset == "ylecun/mnist"
        assert {s.split for s in recipe.evaluation.datasets.values()} == {"test"}
        assert recipe.merge.method == ("ties" if "ties" in name else "task_arithmetic")
        if recipe.merge.method == "ties":
            assert recipe.merge.params["density"] == 0.2
    else:
        assert recipe.base == "google/flan-t5-base"
        assert recipe.tasks == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]
        assert all(e == f"tanganke/flan-t5-base_glue-{t}" for t, e in recipe.experts.items())
        assert all((s.dataset, s.config) == ("nyu-mll/glue", t) for t, s in recipe.calibration.items())
        splits = {t: s.split for t, s in recipe.evaluation.datasets.items()}
        assert splits["mnli"] == "validation_matched" and splits["cola"] == "validation"
    assert cli.main(["run", os.path.join(SHIPPED, name), "--check"]) == 0
    assert "The recipe is valid" in capsys.readouterr().out


# ============================================================================== help, demo
@pytest.mark.parametrize("command", [[], ["merge"], ["calibrate"], ["evaluate"], ["run"], ["push"], ["demo"]])
def test_help_of_every_command(command, capsys):
    assert cli.main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-featcal") and "examples:" in out


def test_usage_errors_return_non_zero(capsys):
    assert cli.main([]) == 2
    assert cli.main(["merge", "--base", "b"]) == 2  # no --expert / --output-dir
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["hf_featcal", "hf_featcal.cli"])
def test_python_dash_m_is_the_command_and_its_help_loads_no_heavy_library(module, monkeypatch, capsys):
    """``python -m hf_featcal`` (and ``-m hf_featcal.cli``) prints the parser's own help, exits with main's
    status (0 for --help, 2 for no command), and --help imports no torch / transformers / datasets."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": os.pathsep.join(sys.path)}
    heavy = ("torch", "transformers", "datasets")
    probe = (f"import runpy, sys\nsys.argv = ['hf-featcal', '--help']\ntry:\n    runpy.run_module({module!r}, "
             "run_name='__main__', alter_sys=True)\nexcept SystemExit as exit_:\n    code = exit_.code\n"
             f"print('LOADED', [m for m in {heavy!r} if m in sys.modules], code)")
    helped = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert helped.returncode == 0, helped.stderr
    monkeypatch.setenv("COLUMNS", "100")
    expected = cli.build_parser().format_help()
    assert helped.stdout == expected + "LOADED [] 0\n"
    bare = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 2 and "the following arguments are required: COMMAND" in bare.stderr


def test_demo_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--fast", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out),
                     "--samples-per-task", "32"]) == 0
    text = capsys.readouterr().out
    for row in ("experts (own task)", "Task Arithmetic (0.3)", "Task Arithmetic + FeatCal", "→"):
        assert row in text
    assert os.path.isfile(out / "featcal_drift.png") and os.path.isfile(out / "README.md")
    assert os.path.isdir(tmp_path / "cache")
