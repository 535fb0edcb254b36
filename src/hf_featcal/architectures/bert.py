"""BERT and RoBERTa encoders (`*Model`, `*ForSequenceClassification` backbones), post-LayerNorm blocks.

Sequence-classification heads read the first token ([CLS] / <s>), so the last block down-weights the
other tokens for every module but the key/value projections. Padding (`attention_mask == 0`) weighs
0. Heads (`classifier`, pooler) are task-specific: they are neither merged nor calibrated — keep each
task's head beside the calibrated encoder.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import LayerMap, RepresentationPoint, Stack, register_layer_map


@register_layer_map
class BertLayerMap(LayerMap):
    model_types = ("bert", "roberta")
    input_names = ("input_ids", "attention_mask", "token_type_ids")
    main_input_name = "input_ids"
    key_value_modules = ("attention.self.key", "attention.self.value")
    shared_input_groups = (("attention.self.query", "attention.self.key", "attention.self.value"),)
    config_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "hidden_act", "layer_norm_eps", "type_vocab_size", "max_position_embeddings")
    checkpoint_prefixes = ("", "bert.", "roberta.")

    def tower(self, model: nn.Module) -> nn.Module:
        for name in ("bert", "roberta"):
            inner = getattr(model, name, None)
            if isinstance(inner, nn.Module):
                return inner
        return model

    def stacks(self, tower: Any) -> list[Stack]:  # Any: submodules by the model class's attribute names
        return [Stack("encoder", tower.encoder.layer, pooled_token_index=0)]

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # the pooler and the classifier read token 0 of the last encoder layer's output
        last = len(self.stacks(self.tower(model))[-1].blocks) - 1
        return self.pooled_token_point(model, f"encoder.layer.{last}", "of the last encoder layer")
