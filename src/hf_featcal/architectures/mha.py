"""`nn.MultiheadAttention` as FeatCal needs to see it: torch's forward reads `out_proj.weight` without
calling `out_proj`, so a capture hook on `out_proj` would never fire; the patch here makes the call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@contextlib.contextmanager
def attention_out_proj_called(root: nn.Module) -> Iterator[None]:
    """While active, every `nn.MultiheadAttention` in `root` computes its attention with the output
    projection as an explicit `out_proj(context)` call, so hooks on `out_proj` see its input
    (torch's own forward uses `out_proj.weight` without calling the module). Same result: the
    context is computed by `F.multi_head_attention_forward` with an identity output projection,
    which is exact. The original forwards are restored on exit, also on error."""
    patched = [m for m in root.modules() if isinstance(m, nn.MultiheadAttention)]
    try:
        for module in patched:
            # an instance attribute shadows the method
            module.forward = _forward_calling_out_proj(module)  # type: ignore[method-assign]
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def _forward_calling_out_proj(mha: nn.MultiheadAttention):
    def forward(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if mha.batch_first:  # F.multi_head_attention_forward takes (sequence, batch, features)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        identity = torch.eye(mha.embed_dim, dtype=query.dtype, device=query.device)
        separate = not mha._qkv_same_embed_dim
        context, weights = F.multi_head_attention_forward(
            query, key, value, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias,
            mha.bias_k, mha.bias_v, mha.add_zero_attn, mha.dropout, identity, None,
            training=mha.training, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, use_separate_proj_weight=separate,
            q_proj_weight=mha.q_proj_weight, k_proj_weight=mha.k_proj_weight, v_proj_weight=mha.v_proj_weight,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )
        out = mha.out_proj(context.transpose(0, 1))  # batch-first, so captured inputs are (batch, tokens, features)
        return (out if mha.batch_first else out.transpose(0, 1)), weights

    return forward
