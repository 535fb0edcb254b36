"""CLIP vision towers: `CLIPVisionModel`, `CLIPVisionModelWithProjection` and `CLIPModel`.

Only the vision tower is calibrated. In transformers 5 a `CLIPVisionModel` *is* the tower
(embeddings, pre-LayerNorm, encoder, post-LayerNorm); `CLIPModel` and the projection model hold it
as `.vision_model`. The head pools the class token (position 0) after `post_layernorm`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import LayerMap, Stack, register_layer_map


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
