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


def stream_drift(ctx: RunContext, merged: list[StreamBatch], expert: list[StreamBatch]) -> float:
    """Σ‖h_merged − h_expert‖₂ / N over the non-padding positions of all batches (all processes)."""
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    count = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for m, e in zip(merged, expert):
        m, e = ctx.fetch(m), ctx.fetch(e)
        mask = (m.weights > 0).to(torch.float64)
        total += ((m.hidden.double() - e.hidden.double()).norm(dim=-1) * mask).sum()
        count += mask.sum()
    total, count = ctx.reduce([total, count])
    return float(total / count)


def record_drift(ctx: RunContext, drift: DriftLog, streams: Streams) -> None:
    """Append each task's drift at the block's output (`streams`: the streams leaving the block)."""
    for task, entry in drift.tasks.items():
        entry["before"].append(stream_drift(ctx, streams.given[task], streams.expert[task]))
        entry["after"].append(stream_drift(ctx, streams.student[task], streams.expert[task]))
