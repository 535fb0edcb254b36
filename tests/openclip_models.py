"""Tiny random-init open_clip models and a merge setting for the tests (tests/test_openclip.py and
the two-process worker)."""

from __future__ import annotations

import copy
import json

import open_clip
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from open_clip.transformer import QuickGELU, VisionTransformer

from testing_utils import perturbed, randomise_norms

WIDTH, LAYERS, HEADS, MLP, IMAGE, PATCH = 16, 2, 2, 32, 8, 4


def tiny_tower(**overrides) -> VisionTransformer:
    kw = dict(image_size=IMAGE, patch_size=PATCH, width=WIDTH, layers=LAYERS, heads=HEADS, mlp_ratio=MLP / WIDTH,
              output_dim=8, act_layer=QuickGELU)
    kw.update(overrides)
    return VisionTransformer(**kw).eval()


def tiny_clip(**vision_overrides) -> CLIP:
    vision = dict(layers=LAYERS, width=WIDTH, head_width=WIDTH // HEADS, mlp_ratio=MLP / WIDTH, patch_size=PATCH,
                  image_size=IMAGE)
    vision.update(vision_overrides)
    text = CLIPTextCfg(context_length=8, vocab_size=64, width=16, heads=2, layers=1)
    return CLIP(embed_dim=8, vision_cfg=CLIPVisionCfg(**vision), text_cfg=text, quick_gelu=True).eval()


def open_clip_setting(generator, build=tiny_clip, tasks=("cars", "dtd"), batch_sizes=(5, 5, 3)):
    """A base, perturbed experts, their Task-Arithmetic merge (0.3) and calibration batches per task."""
    base = build()
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in tasks}
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            p.copy_(
                base.get_parameter(name)
                + 0.3 * sum(e.get_parameter(name) - base.get_parameter(name) for e in experts.values())
            )
    data = {
        t: [{"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=generator)} for n in batch_sizes] for t in tasks
    }
    return base, experts, merged, data


def register_tiny_model_config(folder, name: str) -> str:
    """Register a tiny full-CLIP open_clip config (this file's vision geometry, open_clip's own
    tokenizer vocabulary) under `name` with `open_clip.add_model_config`; returns `name`."""
    cfg = {
        "embed_dim": 8,
        "quick_gelu": True,
        "vision_cfg": {"image_size": IMAGE, "layers": LAYERS, "width": WIDTH, "head_width": WIDTH // HEADS,
                       "mlp_ratio": MLP / WIDTH, "patch_size": PATCH},
        "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    return name


def write_open_clip_recipe_world(folder, generator, model_name: str, names: dict, split_sizes: dict,
                                 featcal_batch_size: int, num_examples: int):
    """An offline open_clip recipe world under `folder`: the tiny `model_name` as base (norms
    randomised), one perturbed expert and one local image dataset (`split_sizes`: split → examples)
    per task of `names` (task → class names), all as folders; returns the path of `recipe.yaml`."""
    import datasets
    import numpy as np
    import yaml
    from PIL import Image

    from hf_featcal.architectures.openclip import OpenCLIPVisionLayerMap, load_open_clip

    base = load_open_clip(model_name)  # a full CLIP: its text tower builds the zero-shot heads
    randomise_norms(base, generator)
    OpenCLIPVisionLayerMap().save_model(base, folder / "base")
    rng = np.random.default_rng(0)
    for task, classes in names.items():
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for p in expert.visual.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        OpenCLIPVisionLayerMap().save_model(expert, folder / "experts" / task)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        datasets.DatasetDict({
            split: datasets.Dataset.from_dict(
                {"image": [Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)) for _ in range(n)],
                 "label": [i % len(classes) for i in range(n)]}, features=features)
            for split, n in split_sizes.items()
        }).save_to_disk(str(folder / "data" / task))
    recipe = {
        "model_family": "open_clip",
        "base": "local-dir:./base",
        "experts": {task: f"local-dir:./experts/{task}" for task in names},
        "merge": {"method": "task_arithmetic", "scaling_factor": 0.3},
        "featcal": {"batch_size": featcal_batch_size},
        "calibration": {"default": {"dataset": "./data/{task}", "split": "train", "num_examples": num_examples}},
        "evaluation": {"split": "test", "batch_size": 4, "class_names": names},
        "output_dir": str(folder / "out"),
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
