"""Tiny random-init open_clip models and a merge setting for the tests (tests/test_openclip.py and
the two-process worker)."""

from __future__ import annotations

import copy
import json

import torch
import open_clip
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from open_clip.transformer import QuickGELU, VisionTransformer

from conftest import perturbed, randomise_norms

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
            p.copy_(base.get_parameter(name) + 0.3 * sum(e.get_parameter(name) - base.get_parameter(name) for e in experts.values()))
    data = {t: [{"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=generator)} for n in batch_sizes] for t in tasks}
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
