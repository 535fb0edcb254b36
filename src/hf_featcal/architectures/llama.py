"""Decoder-only LLMs of the Llama family: Llama, Mistral, Qwen2, Qwen3 (`*Model` and `*ForCausalLM`).

One stack of decoder layers. Each stream enters it through its own model's forward, so it carries
that model's rotary position embeddings and causal/padding mask. Padding (`attention_mask == 0`)
weighs 0; a batch may also select the positions that count with `loss_mask` (1 = counts) or
`labels` (-100 = does not count), e.g. only the response tokens of instruction data. RMS norms
(also Qwen3's per-head q/k norms) use the scale-only closed form; q/k/v (grouped-query shapes
included) and gate/up share their statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .base import LayerMap, Stack, register_layer_map


@register_layer_map
class LlamaFamilyLayerMap(LayerMap):
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    input_names = ("input_ids", "attention_mask")
    main_input_name = "input_ids"
    shared_input_groups = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    )
    config_fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
    )
    rms_norm_classes = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
    # `*ForCausalLM` checkpoints keep the decoder under `model.`
    checkpoint_prefixes = ("", "model.")

    def tower(self, model: nn.Module) -> nn.Module:
        inner = getattr(model, "model", None)
        return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model

    def stacks(self, tower: nn.Module) -> list[Stack]:
        return [Stack("decoder", tower.layers)]

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().model_inputs(batch), "use_cache": False}

    def token_weights(self, batch: Mapping[str, Any], hidden: Tensor, stack: Stack) -> Tensor:
        weights = super().token_weights(batch, hidden, stack)
        for key, counts in (("loss_mask", lambda v: v != 0), ("labels", lambda v: v != -100)):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.shape == weights.shape:
                weights = weights * counts(value).to(weights.dtype)
        return weights
