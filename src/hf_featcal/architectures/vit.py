"""ViT: `ViTModel` and the backbone of `ViTForImageClassification`, pooled on the class token.

The classification head (and the pooler) read the class token after the final LayerNorm, so the last
block down-weights the other tokens for every module but the key/value projections, as for CLIP.
Heads are task-specific: they are neither merged nor calibrated (keep each task's head beside the
calibrated backbone).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import LayerMap, RepresentationPoint, Stack, register_layer_map


@register_layer_map
class ViTLayerMap(LayerMap):
    model_types = ("vit",)
    input_names = ("pixel_values", "interpolate_pos_encoding")
    main_input_name = "pixel_values"
    key_value_modules = ("attention.k_proj", "attention.v_proj")
    shared_input_groups = (("attention.q_proj", "attention.k_proj", "attention.v_proj"),)
    config_fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                     "patch_size", "num_channels", "hidden_act", "layer_norm_eps", "qkv_bias")
    checkpoint_prefixes = ("", "vit.")

    def tower(self, model: nn.Module) -> nn.Module:
        return getattr(model, "vit", model)

    def stacks(self, tower: Any) -> list[Stack]:  # Any: submodules by the model class's attribute names
        return [Stack("encoder", tower.layers, pooled_token_index=0)]

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # the classifier reads the class token after the final layernorm
        return self.pooled_token_point(model, "layernorm", "after the final layernorm")
