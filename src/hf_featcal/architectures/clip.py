"""CLIP vision towers: `CLIPVisionModel`, `CLIPVisionModelWithProjection` and `CLIPModel`.

Only the vision tower is calibrated. In transformers 5 a `CLIPVisionModel` *is* the tower
(embeddings, pre-LayerNorm, encoder, post-LayerNorm); `CLIPModel` and the projection model hold it
as `.vision_model`. The head pools the class token (position 0) after `post_layernorm`.

The map also answers what zero-shot evaluation (`hf_featcal.evaluation.clip_zeroshot`) asks of a CLIP
model: how prompts and images are embedded and whether a bare tower fits a base's projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import VECTOR, LayerMap, RepresentationPoint, Stack, qualified, register_layer_map


@register_layer_map
class CLIPVisionLayerMap(LayerMap):
    model_types = ("clip", "clip_vision_model")
    input_names = ("pixel_values", "interpolate_pos_encoding")
    main_input_name = "pixel_values"
    key_value_modules = ("self_attn.k_proj", "self_attn.v_proj")
    shared_input_groups = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),)
    config_fields = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_channels",
        "image_size",
        "patch_size",
        "hidden_act",
        "layer_norm_eps",
    )

    def tower(self, model: nn.Module) -> nn.Module:
        # CLIPModel / CLIPVisionModelWithProjection wrap the tower; CLIPVisionModel is the tower.
        return getattr(model, "vision_model", model)

    # transformers-4 checkpoints (and CLIPModel ones) store the tower under `vision_model.`
    checkpoint_prefixes = ("", "vision_model.")

    def tower_config(self, config: Any) -> Any:
        return getattr(config, "vision_config", config)

    def stacks(self, tower: Any) -> list[Stack]:  # Any: submodules by the model class's attribute names
        return [Stack("vision_encoder", tower.encoder.layers, pooled_token_index=0)]

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # a model with a projection: the projected image embedding before normalisation (what
        # `get_image_features` returns); a bare tower: the pooled class token the projection reads
        projection = getattr(model, "visual_projection", None)
        if isinstance(projection, nn.Linear):
            return RepresentationPoint("clip", "visual_projection", VECTOR, projection.out_features,
                                       description="the projected image embedding before normalisation")
        norm = getattr(self.tower(model), "post_layernorm", None)
        if not isinstance(norm, nn.LayerNorm):
            raise ValueError(f"`model` ({type(model).__name__}) is a CLIP model without post_layernorm or projection.")
        return RepresentationPoint("clip", qualified(self.tower_prefix(model), "post_layernorm"), VECTOR,
                                   norm.normalized_shape[0],
                                   description="the pooled class token after post_layernorm (what a projection reads)")

    # ------------------------------------------------------------ zero-shot towers
    # What `hf_featcal.evaluation.clip_zeroshot` asks of a model: the transformers CLIP API
    # (`get_text_features`, `get_image_features`, `visual_projection`).
    def has_text_tower(self, model: nn.Module) -> bool:
        """Whether `model` can embed zero-shot prompts."""
        return hasattr(model, "get_text_features")

    # Any: the models are reached through their classes' own methods and submodules (get_text_features,
    # visual_projection), which nn.Module's typing does not know.
    def encode_prompts(self, clip_model: Any, tokenizer: Any, prompts: list[str], device: Any,
                       max_length: int | None) -> torch.Tensor:
        """Unnormalised text embeddings ``[len(prompts), dim]`` of `clip_model`'s text tower."""
        enc = tokenizer(prompts, padding=True, truncation=max_length is not None, max_length=max_length,
                        return_tensors="pt")
        inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        return features(clip_model.get_text_features(**inputs), "text_embeds")

    def image_embeddings(self, vision_model: Any, pixel_values: torch.Tensor,
                         clip_model: Any) -> torch.Tensor:
        """Projected (unnormalised) image embeddings ``[batch, dim]``: ``get_image_features`` of a
        ``CLIPModel``, ``image_embeds`` of a ``CLIPVisionModelWithProjection``, else the base
        ``clip_model.visual_projection`` of a bare tower's pooled output."""
        if hasattr(vision_model, "get_image_features"):
            return features(vision_model.get_image_features(pixel_values=pixel_values), "image_embeds")
        out = vision_model(pixel_values=pixel_values)
        image_embeds = getattr(out, "image_embeds", None)
        if isinstance(image_embeds, torch.Tensor):
            return image_embeds
        self.check_vision_model(vision_model, clip_model)
        pooled = features(out, "pooler_output")
        projection = clip_model.visual_projection  # check_vision_model refused a missing clip_model
        return projection(pooled.to(device=projection.weight.device, dtype=projection.weight.dtype))

    def check_vision_model(self, vision_model: nn.Module, clip_model: Any) -> None:
        """Refuse a bare tower whose pooled output `clip_model`'s ``visual_projection`` cannot map."""
        tower, projection = vision_parts(vision_model)
        if projection is not None:
            return
        if clip_model is None or not isinstance(getattr(clip_model, "visual_projection", None), nn.Linear):
            raise ValueError(
                "vision_model is a bare CLIPVisionModel: clip_model must be the base CLIPModel whose "
                "visual_projection maps its pooled output to the joint embedding space"
            )
        hidden = getattr(getattr(tower, "config", None), "hidden_size", None)
        in_features = clip_model.visual_projection.in_features
        if hidden is not None and hidden != in_features:
            raise ValueError(
                f"vision_model has hidden size {hidden} but clip_model.visual_projection expects {in_features}: "
                "the vision tower does not belong to this CLIP model"
            )


def features(output: Any, *names: str) -> torch.Tensor:
    """The embedding tensor of a model output (a tensor in transformers 4, an output object in 5)."""
    if isinstance(output, torch.Tensor):
        return output
    for name in (*names, "pooler_output"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find embeddings ({', '.join((*names, 'pooler_output'))}) in {type(output).__name__}")


def vision_parts(vision_model: Any) -> tuple[nn.Module, nn.Module | None]:
    """(tower, own projection or None) of a CLIPModel / CLIPVisionModelWithProjection / CLIPVisionModel."""
    if hasattr(vision_model, "visual_projection") and hasattr(vision_model, "vision_model"):
        return vision_model.vision_model, vision_model.visual_projection
    if all(hasattr(vision_model, a) for a in ("embeddings", "encoder", "post_layernorm")):
        return vision_model, None  # transformers 5 CLIPVisionModel: the tower itself
    if hasattr(vision_model, "vision_model"):
        return vision_model.vision_model, None  # transformers 4 CLIPVisionModel
    raise TypeError(
        "vision_model must be a CLIPModel, a CLIPVisionModelWithProjection or a CLIPVisionModel, "
        f"got {type(vision_model).__name__}"
    )
