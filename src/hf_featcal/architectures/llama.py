"""Decoder-only LLMs of the Llama family: Llama, Mistral, Qwen2, Qwen3 (`*Model` and `*ForCausalLM`).

One stack of decoder layers. Each stream enters it through its own model's forward, so it carries
that model's rotary position embeddings and causal/padding mask. Padding (`attention_mask == 0`)
weighs 0; a batch may also select the positions that count with `loss_mask` (1 = counts) or
`labels` (-100 = does not count), e.g. only the response tokens of instruction data. Keys and values
are then fitted on every position a counted position attends to (all non-padding positions up to the
last counted one, by the causal mask) — the analogue of the pooled-token rule for key/value
projections. RMS norms (also Qwen3's per-head q/k norms) use the scale-only closed form; q/k/v
(grouped-query shapes included) and gate/up share their statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..pipeline.streams import StreamBatch
from .base import POSITIONS, LayerMap, RepresentationPoint, Stack, config_hidden_size, qualified, register_layer_map


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

    key_value_modules = ("self_attn.k_proj", "self_attn.v_proj")
    _SELECTORS = ("loss_mask", "labels")
    plans_from_batches = True  # k/v token weights follow whether any task's batches select positions

    def __init__(self) -> None:
        self.restricted_positions = False

    def for_batches(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> LlamaFamilyLayerMap:
        # batches that select positions (labels / loss_mask) give k/v their own token weights
        restricted = any(key in b for bs in batches.values() for b in bs for key in self._SELECTORS)
        if restricted == self.restricted_positions:
            return self
        specialised = copy.copy(self)
        specialised.restricted_positions = restricted
        return specialised

    def weight_source(self, module_name: str) -> str:
        if self.restricted_positions and module_name in self.key_value_modules:
            return "attended"
        return "tokens"

    def input_weights(self, module_name: str, state: StreamBatch) -> Tensor:
        if self.weight_source(module_name) == "attended":
            return state.extras["attended_weights"]
        assert state.weights is not None  # `enter_stack` gives every stream its weights
        return state.weights

    def enter_stack(
        self, tower: nn.Module, batch: Mapping[str, Any], stack_index: int, previous: StreamBatch | None
    ) -> StreamBatch:
        state = super().enter_stack(tower, batch, stack_index, previous)
        if self.restricted_positions:
            padding = LayerMap.token_weights(self, batch, state.hidden, self.stacks(tower)[0])
            assert state.weights is not None  # the base class's `enter_stack` sets them
            counted = (state.weights > 0).int()
            # a position is attended by a counted one when it is at or before the last counted position
            up_to_last = torch.flip(torch.cummax(torch.flip(counted, [1]), dim=1).values, [1])
            state.extras["attended_weights"] = padding * up_to_last.to(padding.dtype)
        return state

    def tower(self, model: nn.Module) -> nn.Module:
        inner = getattr(model, "model", None)
        return inner if isinstance(inner, nn.Module) and hasattr(inner, "layers") else model

    def stacks(self, tower: Any) -> list[Stack]:  # Any: submodules by the model class's attribute names
        return [Stack("decoder", tower.layers)]

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # what lm_head reads: the final norm's output, at the positions `token_weights` weighs
        return RepresentationPoint("decoder_lm", qualified(self.tower_prefix(model), "norm"), POSITIONS,
                                   config_hidden_size(getattr(model, "config", None)),
                                   description="the last hidden state (final norm, what lm_head reads) at the "
                                               "weighted positions")

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().model_inputs(batch), "use_cache": False}

    def token_weights(self, batch: Mapping[str, Any], hidden: Tensor, stack: Stack) -> Tensor:
        weights = super().token_weights(batch, hidden, stack)
        for key, counts in (("loss_mask", lambda v: v != 0), ("labels", lambda v: v != -100)):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.shape == weights.shape:
                weights = weights * counts(value).to(weights.dtype)
        return weights
