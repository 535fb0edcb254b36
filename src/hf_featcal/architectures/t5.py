"""T5 (FLAN-T5 and T5 v1.0): `T5ForConditionalGeneration`, `T5Model` and `T5EncoderModel`.

Two stacks in forward order: the encoder, then the decoder (teacher-forced on the batch's labels).
What a stream carries between blocks is what `T5Stack.forward` passes its blocks, as positional
arguments: (attention mask, position bias, encoder hidden states, encoder mask, cross-attention
position bias). Only block 0 of a stack computes the position biases; the stack hands them to every
later block, so `run_block` stores them in the stream after block 0 — a later block given
`position_bias=None` would silently use zeros. Every stream uses its own model's biases, masks and,
in the decoder, its own encoder output (its own final encoder norm applied).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from ..pipeline.streams import StreamBatch, capture_first_block_inputs
from .base import POSITIONS, LayerMap, RepresentationPoint, Stack, config_hidden_size, register_layer_map

# Positions of the block inputs inside `StreamBatch.args` (the hidden state is not among them).
_POSITION_BIAS = 1
_ENCODER_HIDDEN = 2
_CROSS_POSITION_BIAS = 4

_CROSS_KEY_VALUE = ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")


@register_layer_map
class T5LayerMap(LayerMap):
    model_types = ("t5",)
    input_names = ("input_ids", "attention_mask")
    main_input_name = "input_ids"
    # q/k/v of self-attention, cross-attention keys/values (both read the encoder output) and the
    # gated feed-forward pair read one input each
    shared_input_groups = (
        ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v"),
        _CROSS_KEY_VALUE,
        ("layer.1.DenseReluDense.wi_0", "layer.1.DenseReluDense.wi_1"),
        ("layer.2.DenseReluDense.wi_0", "layer.2.DenseReluDense.wi_1"),
    )
    config_fields = (
        "vocab_size",
        "d_model",
        "d_kv",
        "d_ff",
        "num_layers",
        "num_heads",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
        "feed_forward_proj",
        "layer_norm_epsilon",
        "num_decoder_layers",
    )
    rms_norm_classes = ("T5LayerNorm",)

    def stacks(self, tower: Any) -> list[Stack]:  # Any: submodules by the model class's attribute names
        stacks = [Stack("encoder", tower.encoder.block)]
        decoder = getattr(tower, "decoder", None)
        if decoder is not None:
            stacks.append(Stack("decoder", decoder.block))
        return stacks

    def representation_point(self, model: nn.Module) -> RepresentationPoint:
        # what lm_head reads: the decoder's last hidden state at the target positions; an encoder-only
        # model: the encoder's last hidden state at its non-padding positions
        dim = config_hidden_size(getattr(model, "config", None))
        if getattr(model, "decoder", None) is not None:
            return RepresentationPoint("seq2seq", "decoder.final_layer_norm", POSITIONS, dim,
                                       description="the decoder's last hidden state at the target positions")
        return RepresentationPoint("seq2seq", "encoder.final_layer_norm", POSITIONS, dim,
                                   description="the encoder's last hidden state at the non-padding positions")

    def required_batch_keys(self, model: nn.Module) -> tuple[str, ...]:
        # encoder-decoder models calibrate their decoder on the target text (teacher forcing)
        if getattr(model, "decoder", None) is not None:
            return ("input_ids", "labels")
        return ("input_ids",)

    def input_weights(self, module_name: str, state: StreamBatch) -> Tensor:
        if module_name in _CROSS_KEY_VALUE:
            return state.extras["encoder_weights"]
        assert state.weights is not None  # `enter_stack` gives every stream its weights
        return state.weights

    def enter_stack(
        self, tower: Any, batch: Mapping[str, Any], stack_index: int, previous: StreamBatch | None
    ) -> StreamBatch:
        encoder_mask = batch.get("attention_mask")
        input_ids = batch["input_ids"]
        encoder_weights = _weights(encoder_mask, input_ids.shape, input_ids.device)
        if stack_index == 0:
            args, kwargs = capture_first_block_inputs(
                lambda: tower.encoder(input_ids=input_ids, attention_mask=encoder_mask, use_cache=False),
                tower.encoder.block[0],
            )
            return StreamBatch(args[0], tuple(args[1:]), kwargs, encoder_weights)

        if previous is None:
            raise ValueError("the decoder stack needs the stream's encoder output")
        labels = batch.get("labels")
        if labels is None:
            raise ValueError("encoder-decoder calibration batches need `labels` (the target token ids)")
        # this stream's own encoder output: its own final norm (dropout is off in eval mode)
        encoder_hidden = tower.encoder.dropout(tower.encoder.final_layer_norm(previous.hidden))
        decoder_input_ids = batch.get("decoder_input_ids")
        if decoder_input_ids is None:
            decoder_input_ids = tower._shift_right(labels)
        decoder_mask = batch.get("decoder_attention_mask")
        args, kwargs = capture_first_block_inputs(
            lambda: tower.decoder(
                input_ids=decoder_input_ids,
                attention_mask=decoder_mask,
                encoder_hidden_states=encoder_hidden,
                encoder_attention_mask=encoder_mask,
                use_cache=False,
            ),
            tower.decoder.block[0],
        )
        weights = (labels != -100).to(torch.float32)
        if decoder_mask is not None:
            weights = weights * decoder_mask.to(torch.float32)
        return StreamBatch(args[0], tuple(args[1:]), kwargs, weights, extras={"encoder_weights": encoder_weights})

    def run_block(self, block: nn.Module, block_index: int, state: StreamBatch) -> StreamBatch:
        hidden, self_bias, cross_bias = block(state.hidden, *state.args, **state.kwargs)
        if state.args[_POSITION_BIAS] is not None:
            return replace(state, hidden=hidden)
        # the first block computed this stream's position biases: every later block reuses them
        args = list(state.args)
        args[_POSITION_BIAS] = self_bias
        if len(args) > _CROSS_POSITION_BIAS and args[_ENCODER_HIDDEN] is not None:
            args[_CROSS_POSITION_BIAS] = cross_bias
        return replace(state, hidden=hidden, args=tuple(args))


def _weights(mask: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.float32, device=device)
    return mask.to(device=device, dtype=torch.float32)
