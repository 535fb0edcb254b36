"""open_clip vision towers: `open_clip.transformer.VisionTransformer`, alone or as `.visual` of an
open_clip `CLIP` / `CustomTextCLIP` (only the vision tower is calibrated).

open_clip models have no transformers config: the registry finds this map by class, and `describe`
builds the geometry the experts must share from the modules. Each `ResidualAttentionBlock` holds
`ln_1`, an `nn.MultiheadAttention` (packed `in_proj_weight`, calibrated as its query/key/value rows;
`out_proj`, whose input the base map's capture context exposes), `ln_2` and the `mlp.c_fc` /
`mlp.c_proj` Linears; layer scale (`ls_1`/`ls_2`) stays merged, like every non-Linear, non-norm
parameter. The class-token weighting of the last block applies only with `pool_type='tok'` and no
attentional pooler: with `'avg'` every token reaches the head equally.

Saved the open_clip way: `open_clip_model.safetensors` (the model's own state dict) and, when the
model's open_clip config is known (`load_open_clip` records it), `open_clip_config.json`, so that
`open_clip.create_model("local-dir:<folder>")` (or `"hf-hub:<repo>"` after an upload) loads it back.
Experts and bases given as `"local-dir:<folder>"`, `"hf-hub:<repo>"` or a folder holding
`open_clip_config.json` are read lazily from their safetensors, one block at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .base import VECTOR, LayerMap, LibraryCheckpoint, RepresentationPoint, Stack, register_layer_map

WEIGHTS_NAME = "open_clip_model.safetensors"
CONFIG_NAME = "open_clip_config.json"
#: Where `load_open_clip` records the model's open_clip config (`{"model_cfg", "preprocess_cfg"}`).
CONFIG_ATTRIBUTE = "hf_featcal_open_clip_config"


@dataclass(frozen=True)
class OpenCLIPVisionGeometry:
    """What must agree between open_clip vision towers calibrated together."""

    width: int
    layers: int
    heads: int
    mlp_width: int
    patch_size: tuple[int, ...]
    image_size: tuple[int, ...]
    pool_type: str
    attentional_pool: bool
    layer_scale: bool
    activation: str
    model_type: str = "open_clip_vision"


@register_layer_map
class OpenCLIPVisionLayerMap(LayerMap):
    model_types = ("open_clip_vision",)
    model_classes = (
        "open_clip.model.CLIP",
        "open_clip.model.CustomTextCLIP",
        "open_clip.transformer.VisionTransformer",
    )
    library_name = "open_clip"
    input_names = ("pixel_values",)
    main_input_name = "pixel_values"
    key_value_modules = ("attn.in_proj.k", "attn.in_proj.v")
    config_fields = tuple(f for f in OpenCLIPVisionGeometry.__dataclass_fields__ if f != "model_type")
    # a CLIP model's state dict holds the tower under `visual.`; a bare tower's has no prefix
    checkpoint_prefixes = ("visual.", "")

    def tower(self, model: nn.Module) -> nn.Module:
        return getattr(model, "visual", model)

    def describe(self, model: nn.Module) -> OpenCLIPVisionGeometry:
        tower: Any = self.tower(model)  # Any: open_clip's attributes, which nn.Module's typing cannot see
        blocks = self._blocks(tower)
        first: Any = blocks[0]
        return OpenCLIPVisionGeometry(
            width=first.attn.embed_dim,
            layers=len(blocks),
            heads=first.attn.num_heads,
            mlp_width=first.mlp.c_fc.out_features,
            patch_size=tuple(tower.patch_size),
            image_size=tuple(tower.image_size),
            pool_type=tower.pool_type,
            attentional_pool=tower.attn_pool is not None,
            layer_scale=not isinstance(first.ls_1, nn.Identity),
            activation=type(first.mlp.gelu).__name__,
        )

    def _blocks(self, tower: nn.Module) -> nn.ModuleList:
        transformer = getattr(tower, "transformer", None)
        blocks = getattr(transformer, "resblocks", None)
        if not isinstance(blocks, nn.ModuleList) or not hasattr(tower, "pool_type"):
            raise ValueError(
                f"{type(tower).__name__} is not an open_clip VisionTransformer (no transformer.resblocks)."
            )
        if not getattr(transformer, "batch_first", True):
            raise ValueError("open_clip towers built with batch_first=False are not supported.")
        for index, block in enumerate(blocks):
            if not isinstance(getattr(block, "attn", None), nn.MultiheadAttention):
                raise ValueError(
                    f"open_clip block {index} is a {type(block).__name__} with "
                    f"{type(getattr(block, 'attn', None)).__name__} "
                    "attention; only ResidualAttentionBlock (nn.MultiheadAttention) blocks are supported."
                )
        return blocks

    def stacks(self, tower: nn.Module) -> list[Stack]:
        pooled = 0 if tower.pool_type == "tok" and tower.attn_pool is None else None
        return [Stack("visual", self._blocks(tower), pooled_token_index=pooled)]

    def forward_tower(self, tower: nn.Module, batch: Any) -> Any:
        return tower(batch["pixel_values"])

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # the image tower's output, before `encode_image(normalize=True)` would normalise it
        tower = self.tower(model)
        projection = getattr(tower, "proj", None)
        if isinstance(projection, torch.Tensor):  # an nn.Parameter (width, output_dim)
            dim = int(projection.shape[1])
        else:
            dim = int(getattr(tower, "output_dim", 0)) or int(getattr(tower, "width", 0))
        return RepresentationPoint("open_clip", self.tower_prefix(model), VECTOR, dim,
                                   description="the image tower's output before normalisation")

    @classmethod
    def find_checkpoint(cls, name: str) -> LibraryCheckpoint | None:
        folder = open_clip_folder(name)
        if folder is None:
            return None
        reference = name if name.startswith(_SCHEMES) else LOCAL_DIR + name
        weights = os.path.join(folder, WEIGHTS_NAME) if folder else ""
        if not os.path.isfile(weights):  # e.g. a hub repo with only a pickled checkpoint: loaded whole
            return LibraryCheckpoint(name, lambda: load_open_clip(reference))
        with safe_open(weights, framework="pt") as handle:
            files = {key: weights for key in handle.keys()}

        def describe() -> OpenCLIPVisionGeometry:
            # the geometry, from the model open_clip builds for this config on the meta device (no weights)
            import open_clip

            with torch.device("meta"), _without_random_init_warning():
                skeleton = open_clip.create_model(LOCAL_DIR + folder, load_weights=False, device="meta",
                                                  pretrained_text=False)
            return cls().describe(skeleton)

        return LibraryCheckpoint(name, lambda: load_open_clip(reference), files, describe)

    def save_model(self, model: nn.Module, output_dir: str | os.PathLike) -> None:
        from safetensors.torch import save_model

        os.makedirs(output_dir, exist_ok=True)
        save_model(model, os.path.join(output_dir, WEIGHTS_NAME))
        config = getattr(model, CONFIG_ATTRIBUTE, None)
        if config is not None:
            with open(os.path.join(output_dir, CONFIG_NAME), "w", encoding="utf-8") as handle:
                json.dump(config, handle, indent=2)

    def records_processing(self, processing_class: Any, output_dir: str) -> bool:
        # a torchvision transform or an open_clip tokenizer: open_clip_config.json holds its settings
        module = type(processing_class).__module__
        return (module.startswith(("open_clip.", "torchvision."))
                and os.path.isfile(os.path.join(output_dir, CONFIG_NAME)))

    def pipeline_tag(self, model: nn.Module) -> str | None:
        return "zero-shot-image-classification" if hasattr(model, "encode_text") else "image-feature-extraction"

    # ------------------------------------------------------------ zero-shot towers
    # open_clip's own API: `encode_text` / `encode_image`, or a bare tower's projected output.
    def has_text_tower(self, model: nn.Module) -> bool:
        return hasattr(model, "encode_text")

    # Any: open_clip models are reached through their own methods (encode_text, encode_image)
    def encode_prompts(self, clip_model: Any, tokenizer: Any, prompts: list[str], device: Any,
                       max_length: int | None) -> torch.Tensor:
        # open_clip tokenizers return the padded token ids
        return clip_model.encode_text(tokenizer(prompts).to(device))

    def image_embeddings(self, vision_model: Any, pixel_values: torch.Tensor,
                         clip_model: nn.Module | None) -> torch.Tensor:
        # CLIP.encode_image, or a bare VisionTransformer's projected output
        if hasattr(vision_model, "encode_image"):
            return vision_model.encode_image(pixel_values)
        return vision_model(pixel_values)

    def check_vision_model(self, vision_model: nn.Module, clip_model: nn.Module | None) -> None:
        if getattr(getattr(vision_model, "visual", vision_model), "proj", None) is None:
            raise ValueError("vision_model is an open_clip tower without a projection (proj is None)")



LOCAL_DIR, HF_HUB = "local-dir:", "hf-hub:"


def is_open_clip_model(model: Any) -> bool:
    """Whether `model` is an open_clip model (or one of its modules), by where its class is defined."""
    return type(model).__module__.startswith("open_clip.")


@contextlib.contextmanager
def _without_random_init_warning() -> Iterator[None]:
    """Silence open_clip's "No pretrained weights loaded … initialized randomly" (logged on the root
    logger) while building a weightless skeleton on purpose."""

    def keep(record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)
_SCHEMES = (LOCAL_DIR, HF_HUB)


def open_clip_folder(name: str) -> str | None:
    """The local folder of the open_clip checkpoint `name` refers to: `"local-dir:<folder>"`, a folder
    holding `open_clip_config.json`, or `"hf-hub:<repo>"` (its config and safetensors, fetched; "" when
    the hub cannot be reached, so the caller's load reports the error). None if `name` is not one."""
    if name.startswith(HF_HUB):
        from huggingface_hub import snapshot_download

        try:  # only open_clip's own files (such repos often hold transformers weights too)
            return snapshot_download(name[len(HF_HUB):], allow_patterns=[CONFIG_NAME, WEIGHTS_NAME])
        except Exception:  # noqa: BLE001 - offline / unknown repo: the caller's load reports it
            return ""
    path = name[len(LOCAL_DIR):] if name.startswith(LOCAL_DIR) else name
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return path
    if name.startswith(LOCAL_DIR):
        raise ValueError(f"{name!r} is not an open_clip folder: no {CONFIG_NAME} in {path!r}.")
    return None


def load_open_clip(name: str, pretrained: str | None = None, **kwargs: Any) -> nn.Module:
    """An open_clip model (`open_clip.create_model(name, pretrained, **kwargs)`, in eval mode) with its
    open_clip config recorded, so that a calibrated copy saves with `open_clip_config.json`.

    `name`: a built-in model name (`"ViT-B-32"`, with `pretrained` a tag or a weights file),
    `"hf-hub:<repo>"`, `"local-dir:<folder>"` or a folder saved by `FeatCalCalibrator.save_model`.
    """
    import open_clip

    if not name.startswith(_SCHEMES) and os.path.isdir(name):
        name = LOCAL_DIR + name
    model = open_clip.create_model(name, pretrained=pretrained, **kwargs)
    setattr(model, CONFIG_ATTRIBUTE, {
        "model_cfg": _model_cfg(name, kwargs),
        "preprocess_cfg": open_clip.get_model_preprocess_cfg(model),
    })
    return model.eval()


def _model_cfg(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The open_clip model config `create_model(name, **overrides)` built its model from."""
    import open_clip

    if name.startswith(_SCHEMES):
        if name.startswith(LOCAL_DIR):
            path = os.path.join(name[len(LOCAL_DIR):], CONFIG_NAME)
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name[len(HF_HUB):], CONFIG_NAME)
        with open(path, encoding="utf-8") as handle:
            cfg = json.load(handle)["model_cfg"]
    else:
        cfg = open_clip.get_model_config(name)
    if overrides.get("force_quick_gelu"):
        cfg["quick_gelu"] = True
    if overrides.get("force_custom_text"):
        cfg["custom_text"] = True
    if overrides.get("force_image_size") is not None:
        cfg["vision_cfg"]["image_size"] = overrides["force_image_size"]
    if overrides.get("force_patch_dropout") is not None:
        cfg["vision_cfg"]["patch_dropout"] = overrides["force_patch_dropout"]
    if overrides.get("force_context_length") is not None:
        cfg["text_cfg"]["context_length"] = overrides["force_context_length"]
    return cfg


def load_open_clip_processing(name: str) -> tuple[Any, Any]:
    """(tokenizer, evaluation image transform) of the open_clip checkpoint `name` (`local-dir:`,
    `hf-hub:` or a folder), as open_clip builds them from its `open_clip_config.json`."""
    import open_clip

    folder = open_clip_folder(name)
    if not folder:
        raise ValueError(f"{name!r} is not an open_clip folder or a reachable open_clip hub repository")
    with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as handle:
        config = json.load(handle)
    tokenizer = open_clip.get_tokenizer(LOCAL_DIR + folder)
    preprocess_cfg = config.get("preprocess_cfg") or {}
    preprocess = open_clip.image_transform(
        preprocess_cfg.get("size") or config["model_cfg"]["vision_cfg"]["image_size"],
        is_train=False,
        mean=preprocess_cfg.get("mean"),
        std=preprocess_cfg.get("std"),
        resize_mode=preprocess_cfg.get("resize_mode"),
        interpolation=preprocess_cfg.get("interpolation"),
    )
    return tokenizer, preprocess
