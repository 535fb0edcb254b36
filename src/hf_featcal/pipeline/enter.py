"""Stage *enter streams*: every task's batches enter a stack, through the merged model or an expert
(the three streams are described in `pipeline/streams.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from accelerate.utils import send_to_device

from ..data import Batch
from ..experts import ModelSource, module_device
from .context import RunContext
from .streams import StreamBatch, Streams, TaskStreams


def enter_stack(
    ctx: RunContext,
    stack_index: int,
    streams: Streams,
    batches: Mapping[str, list[Batch]],
    experts: Mapping[str, ModelSource],
    drift: bool,
    student: TaskStreams | None = None,
) -> Streams:
    """Every stream entering stack `stack_index` (`streams`: the same streams leaving the previous
    stack; `student`: the student stream when it has entered already, as the first stack's has where
    `check_batches_enter_model` ran the merged model's input path on the batches)."""
    tasks = list(experts)
    if student is None:
        student = {t: enter(ctx, None, stack_index, streams.student, batches[t], t) for t in tasks}
    expert = {t: enter(ctx, experts[t], stack_index, streams.expert, batches[t], t) for t in tasks}
    given = None
    if drift:
        given = {t: (student[t] if stack_index == 0 else enter(ctx, None, stack_index, streams.given, batches[t], t))
                 for t in tasks}
    return Streams(student, expert, given)


def enter(
    ctx: RunContext,
    source: ModelSource | None,
    stack_index: int,
    previous: TaskStreams | None,
    batches: list[Batch],
    task: str,
) -> list[StreamBatch]:
    """Each batch of one task's stream entering a stack: through the merged model (`source` None) or
    a source's own input path."""
    states = []
    merged = ctx.tower
    entry = contextlib.nullcontext(merged) if source is None else source.entry_tower(ctx.model)
    with entry as tower:
        merged_tower = tower is merged  # also for experts read from files
        source_device = ctx.input_device(tower) if merged_tower else module_device(tower)
        for b, batch in enumerate(batches):
            prev = None if previous is None else send_to_device(previous[task][b], source_device)
            state = ctx.layer_map.enter_stack(tower, send_to_device(batch, source_device), stack_index, prev)
            states.append(ctx.park(state))
    return states
