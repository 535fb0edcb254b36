"""Stage *drift*: the merged-as-given stream through each block, and per task and block the mean
distance of the merged streams from the expert's, and the relative distance of what the task's head reads.

The report is a diagnostic: it measures a bounded sample of each task's calibration examples
(`FeatCalConfig.drift_samples_per_task`, `DriftSample`), and the merged-as-given stream exists for
those examples only. The student and expert streams are the calibration's own; the report reads
the sample's rows of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..data import Batch, batch_size_of, cut_batch
from .accumulate import pooled_weighting
from .context import RunContext
from .streams import StreamBatch, Streams, TaskStreams

#: The stages of a task's entry: the absolute drift and the head's relative drift, before and after.
DRIFT_STAGES = ("before", "after", "head_before", "head_after")
#: The same stages on the held-out examples (`FeatCalConfig.heldout_fraction`), where there are some.
HELDOUT_STAGES = tuple(f"heldout_{stage}" for stage in DRIFT_STAGES)


@dataclass
class DriftLog:
    """task → {"before": one value per block for the merged model as given, "after": for the calibrated
    one; "head_before" / "head_after": the same blocks' relative drift under the head's token weights;
    with held-out examples the same four on them, prefixed "heldout_"}."""

    tasks: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, tasks: list[str], heldout: bool = False) -> DriftLog:
        """No block yet; with `heldout`, the held-out stages (`HELDOUT_STAGES`) too."""
        stages = DRIFT_STAGES + (HELDOUT_STAGES if heldout else ())
        return cls({task: {stage: [] for stage in stages} for task in tasks})


@dataclass(frozen=True)
class DriftSample:
    """The examples the drift report measures: per task, (index of a batch of this process, how many of
    its first examples), in batch order, and how many examples that is per task over all processes."""

    rows: dict[str, list[tuple[int, int]]]
    examples_per_task: dict[str, int]

    @classmethod
    def choose(
        cls, batches: Mapping[str, list[Batch]], limit: int | None, seed: int, main_input_name: str,
        rank: int = 0, world: int = 1,
    ) -> DriftSample:
        """At most `limit` examples of each task's `batches` (every process's, before they are shared
        out; None: all): whole batches in an order drawn with `seed` (the same for every task), the last
        one cut to its first examples. Batch `g` goes to process `g % world` as its batch `g // world`,
        as the calibrator shares them out, so the sample does not depend on the number of processes."""
        rows, counts = {}, {}
        for task, task_batches in batches.items():
            sizes = [batch_size_of(b, main_input_name) for b in task_batches]
            order = list(range(len(sizes)))
            if limit is not None and limit < sum(sizes):
                order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
            chosen, used = [], 0
            for g in order:
                if limit is not None and used >= limit:
                    break
                take = sizes[g] if limit is None else min(sizes[g], limit - used)
                chosen.append((g, take))
                used += take
            rows[task] = [(g // world, take) for g, take in sorted(chosen) if g % world == rank]
            counts[task] = used
        return cls(rows, counts)

    @classmethod
    def union(cls, samples: list[DriftSample]) -> DriftSample:
        """One sample of the tasks of `samples` (each chosen for its own tasks)."""
        return cls({t: r for s in samples for t, r in s.rows.items()},
                   {t: n for s in samples for t, n in s.examples_per_task.items()})

    def batches(self, task: str, batches: list[Batch], main_input_name: str) -> list[Batch]:
        """The sample's calibration batches of one task (this process's `batches`), cut where it takes
        only their first examples."""
        out = []
        for b, take in self.rows[task]:
            size = batch_size_of(batches[b], main_input_name)
            out.append(batches[b] if take == size else cut_batch(batches[b], size, take))
        return out

    def of(self, task: str, stream: list[StreamBatch]) -> list[StreamBatch]:
        """The sample's rows of one task's stream (indexed by batch): whole batches as they are; a cut
        one as its first rows' hidden states and token weights, what `stream_drifts` reads."""
        out = []
        for b, take in self.rows[task]:
            state = stream[b]
            if take == state.hidden.shape[0]:
                out.append(state)
            else:
                assert state.weights is not None  # every stream batch carries its token weights
                out.append(StreamBatch(state.hidden[:take], weights=state.weights[:take]))
        return out

    def whole(self, task: str, stream: list[StreamBatch]) -> list[bool]:
        """Per sampled batch, whether the sample takes all of it (its rows are the stream's batch itself)."""
        return [take == stream[b].hidden.shape[0] for b, take in self.rows[task]]

    def positional(self, streams: Mapping[str, list[StreamBatch]]) -> DriftSample:
        """The same sample for streams that hold only the sampled batches, in sample order."""
        rows = {task: [(j, take) for j, (_, take) in enumerate(self.rows[task])] for task in streams}
        return DriftSample(rows, self.examples_per_task)


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


def record_drift(
    ctx: RunContext, drift: DriftLog, streams: Streams, sample: DriftSample, pooled_token_index: int | None = None
) -> None:
    """Append each task's drift at the block's output (`streams`: the streams leaving the block, the
    merged-as-given one holding the `sample`'s examples; `pooled_token_index`: the token a head reads
    after this block, if it is a pooled stack's last)."""
    assert streams.given is not None and streams.student is not None and streams.expert is not None  # with drift
    for task, entry in drift.tasks.items():
        (before, after), (head_before, head_after) = stream_drifts(
            ctx, [streams.given[task], sample.of(task, streams.student[task])], sample.of(task, streams.expert[task]),
            pooled_token_index,
        )
        for stage, value in zip(DRIFT_STAGES, (before, after, head_before, head_after), strict=True):
            entry.setdefault(stage, []).append(value)


def record_heldout_drift(ctx: RunContext, drift: DriftLog, streams: Streams, pooled_token_index: int | None = None
                         ) -> None:
    """Append each task's held-out drift at the block's output (`streams`: the streams leaving the block,
    with every held-out stream): the merged model as given and the calibrated (guarded) one."""
    assert (streams.heldout_given is not None and streams.heldout_student is not None
            and streams.heldout_expert is not None)  # with held-out examples and the drift report
    for task, entry in drift.tasks.items():
        (before, after), (head_before, head_after) = stream_drifts(
            ctx, [streams.heldout_given[task], streams.heldout_student[task]], streams.heldout_expert[task],
            pooled_token_index,
        )
        for stage, value in zip(HELDOUT_STAGES, (before, after, head_before, head_after), strict=True):
            entry.setdefault(stage, []).append(value)


def advance_heldout_given(ctx: RunContext, block: nn.Module, block_index: int, given: TaskStreams,
                          shared: Mapping[str, list[bool]] | None = None, student: TaskStreams | None = None
                          ) -> TaskStreams:
    """The held-out merged-as-given stream leaving `block` as given (run before its solutions are
    written). With `shared` (per task and batch, whether the given batch entering the block was the
    held-out student's) and `student` (the held-out student stream leaving an unchanged block), such a
    batch stays the student's."""
    out = {}
    with ctx.precision():
        for task, states in given.items():
            out[task] = [
                student[task][b] if student is not None and shared is not None and shared[task][b]
                else ctx.run_block(block, block_index, state)
                for b, state in enumerate(states)
            ]
    return out


def shared_with_student(streams: Streams, sample: DriftSample) -> dict[str, list[bool]]:
    """Per task and sampled batch, whether the merged-as-given batch entering a block *is* the student's
    (as it is until a block is calibrated): such a batch leaves an unchanged block as the student's does."""
    assert streams.given is not None and streams.student is not None  # the streams entering the block, with drift
    return {
        task: [state is streams.student[task][b] for state, (b, _) in zip(states, sample.rows[task], strict=True)]
        for task, states in streams.given.items()
    }


def advance_given(
    ctx: RunContext,
    block: nn.Module,
    block_index: int,
    given: TaskStreams,
    sample: DriftSample,
    shared: Mapping[str, list[bool]] | None = None,
    student: Mapping[str, Mapping[int, StreamBatch] | list[StreamBatch]] | None = None,
) -> TaskStreams:
    """The merged-as-given stream (`given`, the `sample`'s batches) leaving `block` as given (run before
    its solutions are written). With `shared` (`shared_with_student`, taken before the student stream
    moved on) and `student` (task → batch index → the student batch leaving the block as given: the
    student stream leaving an unchanged block, or the capture pass's `student_as_given`), a batch that
    was the student's is taken from `student`; every other batch runs through the block, hooks off."""
    out = {}
    with ctx.precision():
        for task, states in given.items():
            out[task] = [
                student[task][b] if student is not None and shared is not None and shared[task][j]
                else ctx.run_block(block, block_index, state)
                for j, (state, (b, _)) in enumerate(zip(states, sample.rows[task], strict=True))
            ]
    return out


def student_batches_as_given(shared: Mapping[str, list[bool]], sample: DriftSample) -> dict[str, set[int]]:
    """Per task, the student batches (by index) that are also merged-as-given batches (`shared`, from
    `shared_with_student`): the capture pass runs them to the block's end (`capture_block`'s `whole`)."""
    return {task: {b for (b, _), same in zip(sample.rows[task], flags, strict=True) if same}
            for task, flags in shared.items()}
