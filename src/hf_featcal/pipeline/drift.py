"""Stage *drift*: the merged-as-given stream through each block, and per task and block the mean
distance of the merged streams from the expert's, and the relative distance of what the task's head reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .accumulate import pooled_weighting
from .context import RunContext
from .streams import StreamBatch, Streams, TaskStreams

#: The stages of a task's entry: the absolute drift and the head's relative drift, before and after.
DRIFT_STAGES = ("before", "after", "head_before", "head_after")


@dataclass
class DriftLog:
    """task → {"before": one value per block for the merged model as given, "after": for the calibrated
    one; "head_before" / "head_after": the same blocks' relative drift under the head's token weights}."""

    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, tasks: list[str]) -> DriftLog:
        return cls({task: {stage: [] for stage in DRIFT_STAGES} for task in tasks})


def stream_drifts(
    ctx: RunContext,
    merged: list[list[StreamBatch]],
    expert: list[StreamBatch],
    pooled_token_index: int | None = None,
) -> tuple[list[float], list[float]]:
    """For each of several merged streams of one task (the same batches): Σ‖h_merged − h_expert‖₂ / N
    over the non-padding positions of all batches (all processes), and the head's relative drift
    Σ w‖h_merged − h_expert‖₂ / Σ w‖h_expert‖₂ with the token weights w of the block's statistics
    (padding 0; with `pooled_token_index`, a pooled stack's last block, every other token
    `final_block_token_weight`): what a head reading that output sees move, relative to its size.

    Each token's distance is taken in float32 (or the streams' dtype when wider): the difference of
    two float32 numbers is rounded once, and the norm of one token's few thousand channels is exact
    to ~1e-7 relative; the distances are summed in float64. Widening every stream to float64 first
    cost ~5× as much for the same value to ~1e-8."""
    zero = torch.zeros((), dtype=torch.float64, device=ctx.device)
    totals, counts = [zero.clone() for _ in merged], [zero.clone() for _ in merged]
    head_totals, head_sizes = [zero.clone() for _ in merged], [zero.clone() for _ in merged]
    other_weight = ctx.config.final_block_token_weight
    for b, e in enumerate(expert):
        e_hidden = ctx.fetch(e).hidden
        e_hidden = e_hidden.to(torch.promote_types(e_hidden.dtype, torch.float32))
        e_sizes = torch.linalg.vector_norm(e_hidden, dim=-1).double()
        for i, stream in enumerate(merged):
            m = ctx.fetch(stream[b])
            assert m.weights is not None  # a stream's batches carry their token weights
            mask = (m.weights > 0).to(torch.float64)
            distances = torch.linalg.vector_norm(torch.sub(m.hidden.to(e_hidden.dtype), e_hidden), dim=-1).double()
            totals[i] += (distances * mask).sum()
            counts[i] += mask.sum()
            head = (m.weights if pooled_token_index is None
                    else pooled_weighting(m.weights, pooled_token_index, other_weight))
            head = head.to(torch.float64)
            head_totals[i] += (distances * head).sum()
            head_sizes[i] += (e_sizes * head).sum()
    reduced = ctx.reduce([*totals, *counts, *head_totals, *head_sizes])
    n = len(merged)
    drifts = [float(total / count) for total, count in zip(reduced[:n], reduced[n : 2 * n], strict=True)]
    heads = [float(total / size) if float(size) > 0 else 0.0
             for total, size in zip(reduced[2 * n : 3 * n], reduced[3 * n :], strict=True)]
    return drifts, heads


def record_drift(ctx: RunContext, drift: DriftLog, streams: Streams, pooled_token_index: int | None = None) -> None:
    """Append each task's drift at the block's output (`streams`: the streams leaving the block;
    `pooled_token_index`: the token a head reads after this block, if it is a pooled stack's last)."""
    assert streams.given is not None and streams.student is not None and streams.expert is not None  # with drift
    for task, entry in drift.tasks.items():
        (before, after), (head_before, head_after) = stream_drifts(
            ctx, [streams.given[task], streams.student[task]], streams.expert[task], pooled_token_index
        )
        for stage, value in zip(DRIFT_STAGES, (before, after, head_before, head_after), strict=True):
            entry.setdefault(stage, []).append(value)


def advance_given(
    ctx: RunContext, block: nn.Module, block_index: int, streams: Streams, student: TaskStreams | None = None
) -> TaskStreams:
    """The merged-as-given stream leaving `block` as given (run before its solutions are written). Its
    batches are the student's until a block is calibrated: with `student`, the student batches leaving
    an unchanged block, those stay shared; every other batch runs through the block, hooks off."""
    given = {}
    assert streams.given is not None and streams.student is not None  # the streams entering the block, with drift
    with ctx.precision():
        for task, states in streams.given.items():
            entering = streams.student[task]
            given[task] = [
                student[task][b] if student is not None and state is entering[b]
                else ctx.run_block(block, block_index, state)
                for b, state in enumerate(states)
            ]
    return given
