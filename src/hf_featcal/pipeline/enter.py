"""Stage *enter streams*: every task's batches enter a stack, through the merged model or an expert
(the three streams are described in `pipeline/streams.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from accelerate.utils import send_to_device

from .._kernels.convolutions import patch_products
from ..data import Batch, batch_size_of
from ..experts import ModelSource, module_device
from .context import RunContext
from .drift import DriftSample
from .streams import StreamBatch, Streams, TaskStreams


def enter_stack(
    ctx: RunContext,
    stack_index: int,
    streams: Streams,
    batches: dict[str, list[Batch]],
    experts: Mapping[str, ModelSource],
    drift: DriftSample | None,
    student: TaskStreams | None = None,
    release: bool = False,
    heldout: dict[str, list[Batch]] | None = None,
) -> Streams:
    """Every stream entering stack `stack_index` (`streams`: the same streams leaving the previous
    stack; `student`: the student stream when it has entered already, as the first stack's has where
    `check_batches_enter_model` ran the merged model's input path on the batches). With the drift
    report, the merged-as-given stream holds `drift`'s examples: entering the first stack, a batch
    the sample takes whole *is* the student's, a cut one enters on its own.

    With `release` (the last stack: nothing reads the calibration batches again), each task's
    batches are replaced by an empty list in `batches` once its streams have entered, so that the
    inputs (images: 0.6 MB each at 224²) and the streams are not held together for every task.

    With `heldout` (task → this process's held-out batches, `FeatCalConfig.heldout_fraction`), their
    student and expert streams enter beside the calibration streams, and with the drift report their
    merged-as-given stream (entering the first stack, the student's batches themselves); `release`
    empties their lists too."""
    main_input = ctx.layer_map.main_input_name
    entered = Streams({}, {}, None if drift is None else {})
    if heldout is not None:
        entered.heldout_student, entered.heldout_expert = {}, {}
        entered.heldout_given = None if drift is None else {}
    for t in experts:
        assert entered.student is not None and entered.expert is not None  # built above
        entered.student[t] = (enter(ctx, None, stack_index, streams.student, batches[t], t) if student is None
                              else student[t])
        entered.expert[t] = enter(ctx, experts[t], stack_index, streams.expert, batches[t], t)
        if drift is not None and entered.given is not None:
            sampled = drift.batches(t, batches[t], main_input)
            if stack_index:
                entered.given[t] = enter(ctx, None, stack_index, streams.given, sampled, t)
            else:
                entered.given[t] = [
                    entered.student[t][b] if take == batch_size_of(batches[t][b], main_input)
                    else enter(ctx, None, stack_index, None, [batch], t)[0]
                    for (b, take), batch in zip(drift.rows[t], sampled, strict=True)
                ]
        if heldout is not None:
            enter_heldout(ctx, stack_index, streams, entered, heldout, experts[t], t)
            if release:
                heldout[t] = []
        if release:
            batches[t] = []
    return entered


def enter_heldout(
    ctx: RunContext,
    stack_index: int,
    streams: Streams,
    entered: Streams,
    heldout: dict[str, list[Batch]],
    expert: ModelSource,
    task: str,
) -> None:
    """One task's held-out streams entering a stack into `entered` (from `streams`, those leaving the
    previous stack): the student's and the expert's, and the merged-as-given one where `entered` has it."""
    assert entered.heldout_student is not None and entered.heldout_expert is not None  # set up by enter_stack
    entered.heldout_student[task] = enter(ctx, None, stack_index, streams.heldout_student, heldout[task], task)
    entered.heldout_expert[task] = enter(ctx, expert, stack_index, streams.heldout_expert, heldout[task], task)
    if entered.heldout_given is not None:
        # entering the first stack the model as given is the student: the same batches
        entered.heldout_given[task] = (
            list(entered.heldout_student[task]) if not stack_index
            else enter(ctx, None, stack_index, streams.heldout_given, heldout[task], task)
        )


def enter(
    ctx: RunContext,
    source: ModelSource | None,
    stack_index: int,
    previous: TaskStreams | None,
    batches: list[Batch],
    task: str,
) -> list[StreamBatch]:
    """Each batch of one task's stream entering a stack: through the merged model (`source` None) or
    a source's own input path (its patch embedding as one product on the CPU, `_kernels.convolutions`)."""
    states = []
    merged = ctx.tower
    entry = contextlib.nullcontext(merged) if source is None else source.entry_tower(ctx.model)
    with entry as tower, patch_products(tower):
        merged_tower = tower is merged  # also for experts read from files
        source_device = ctx.input_device(tower) if merged_tower else module_device(tower)
        for b, batch in enumerate(batches):
            prev = None if previous is None else send_to_device(previous[task][b], source_device)
            state = ctx.layer_map.enter_stack(tower, send_to_device(batch, source_device), stack_index, prev)
            states.append(ctx.park(state))
    return states
