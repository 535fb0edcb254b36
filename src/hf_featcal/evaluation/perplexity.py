"""Held-out perplexity of a causal language model on tokenised texts.

Each text is scored on its own (right-padded in batches; a padded position is neither read by the real
tokens, which attend only backwards, nor predicted): the negative log-likelihood of every token after
the first, summed over all texts, divided by the number of predicted tokens, exponentiated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["perplexity"]


def perplexity(
    model: Any,
    input_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    batch_size: int = 8,
    device: Any = None,
) -> dict[str, float]:
    """``{"perplexity", "nll_per_token", "tokens", "texts"}`` of `model` (a ``*ForCausalLM``) on the
    token id lists `input_ids` (texts of one token predict nothing and are skipped)."""
    import torch
    import torch.nn.functional as F

    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    rows = [list(ids) for ids in input_ids if len(ids) > 1]
    if not rows:
        raise ValueError("perplexity needs at least one text of two or more tokens")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                width = max(len(ids) for ids in chunk)
                ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, row in enumerate(chunk):
                    ids[i, :len(row)] = torch.tensor(row)
                    mask[i, :len(row)] = 1
                ids, mask = ids.to(device), mask.to(device)
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # padding is never predicted
                nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                      ignore_index=-100, reduction="sum")
                total += float(nll)
                count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    mean = total / count
    return {"perplexity": math.exp(mean), "nll_per_token": mean, "tokens": float(count), "texts": float(len(rows))}
