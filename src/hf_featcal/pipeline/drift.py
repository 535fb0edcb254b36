"""Stage *drift*: per task and block, the mean distance of the merged streams from the expert's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..streams import StreamBatch
from .context import RunContext
from .enter import Streams


@dataclass
class DriftLog:
    """task → {"before": one value per block for the merged model as given, "after": for the calibrated one}."""

    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, tasks: list[str]) -> DriftLog:
        return cls({task: {"before": [], "after": []} for task in tasks})


def stream_drifts(ctx: RunContext, merged: list[list[StreamBatch]], expert: list[StreamBatch]) -> list[float]:
    """For each of several merged streams of one task (the same batches), Σ‖h_merged − h_expert‖₂ / N
    over the non-padding positions of all batches (all processes).

    Each token's distance is taken in float32 (or the streams' dtype when wider): the difference of
    two float32 numbers is rounded once, and the norm of one token's few thousand channels is exact
    to ~1e-7 relative; the distances are summed in float64. Widening every stream to float64 first
    cost ~5× as much for the same value to ~1e-8."""
    totals = [torch.zeros((), dtype=torch.float64, device=ctx.device) for _ in merged]
    counts = [torch.zeros((), dtype=torch.float64, device=ctx.device) for _ in merged]
    for b, e in enumerate(expert):
        e_hidden = ctx.fetch(e).hidden
        e_hidden = e_hidden.to(torch.promote_types(e_hidden.dtype, torch.float32))
        for stream, total, count in zip(merged, totals, counts):
            m = ctx.fetch(stream[b])
            mask = (m.weights > 0).to(torch.float64)
            distances = torch.linalg.vector_norm(torch.sub(m.hidden.to(e_hidden.dtype), e_hidden), dim=-1)
            total += (distances.double() * mask).sum()
            count += mask.sum()
    reduced = ctx.reduce([*totals, *counts])
    return [float(total / count) for total, count in zip(reduced[: len(merged)], reduced[len(merged) :])]


def record_drift(ctx: RunContext, drift: DriftLog, streams: Streams) -> None:
    """Append each task's drift at the block's output (`streams`: the streams leaving the block)."""
    for task, entry in drift.tasks.items():
        before, after = stream_drifts(ctx, [streams.given[task], streams.student[task]], streams.expert[task])
        entry["before"].append(before)
        entry["after"].append(after)
