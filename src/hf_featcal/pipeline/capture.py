"""Stage *capture*: run one block on every task's student and expert streams with hooks on the
modules being calibrated, and hand each batch's captured inputs to the accumulators."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from ..experts import ModelSource
from ..hooks import StopForward, capture_module_inputs, capture_module_outputs, eval_mode
from .accumulate import BlockStatistics, accumulate, expert_targets, finish_task, new_statistics, output_groups
from .context import RunContext
from .streams import Streams, TaskStreams
from .plan import BlockPlan


@dataclass
class CapturedBlock:
    """What one pass over a block leaves: the folded statistics (empty when nothing is solved), the
    expert and merged-as-given streams leaving the block, and — only when nothing is solved here —
    the student stream leaving it (otherwise it is propagated through the calibrated block)."""

    statistics: BlockStatistics
    expert: TaskStreams
    given: TaskStreams | None
    student: TaskStreams | None


def capture_block(
    ctx: RunContext,
    plan: BlockPlan,
    block: nn.Module,
    streams: Streams,
    experts: Mapping[str, ModelSource],
    note: Callable[[str], None] = lambda _: None,
    leaving: bool = True,
) -> CapturedBlock:
    """One pass of every task's streams through the block (the merged `block` and the task
    expert's), accumulating statistics per task; `note` receives progress messages.

    With `leaving=False` (a later step of module granularity, `pipeline/steps.py`) only the
    statistics are wanted: both forwards stop once the plan's inputs are captured, and no stream
    leaving the block is computed (the returned streams are empty)."""
    lm, bi = ctx.layer_map, plan.block_index
    calibrating = plan.calibrating
    statistics = new_statistics(ctx, plan, block) if calibrating else BlockStatistics()
    sources = plan.capture_sources
    last_source: str | None = None  # the last captured module in forward order, once seen
    given = streams.given
    new_student: TaskStreams = {}
    new_expert: TaskStreams = {}
    new_given: TaskStreams | None = {} if given is not None and leaving else None
    for task, source in experts.items():
        note(f"{'collecting statistics' if calibrating else 'forwarding'} · {task}")
        with ctx.timed("loading expert blocks"):
            expert_block = source.block(lm, ctx.model, plan.stack_index, bi, ctx.device)
            targets = expert_targets(plan, statistics, expert_block)
            # (a statistics-only pass stops the expert's forward before the last module's output)
            from_outputs = output_groups(ctx, plan, statistics, expert_block, streams.student[task]) if leaving else {}
        new_student[task], new_expert[task] = [], []
        if new_given is not None:
            new_given[task] = []
        with (
            ctx.precision(),
            eval_mode(expert_block),
            lm.capture_context(block),
            lm.capture_context(expert_block),
            capture_module_inputs(block, sources) as xs,
            capture_module_inputs(expert_block, sources) as xe,
            capture_module_outputs(expert_block, {n for names in from_outputs.values() for n in names}) as ye,
        ):
            for b, parked in enumerate(streams.student[task]):
                # the student's output of the uncalibrated block is only needed while it is also the
                # merged-as-given stream, or when nothing is solved here; otherwise its forward can stop
                # once the last module input is captured (the expert's must run on: it feeds the next block)
                needed = not calibrating or (new_given is not None and given[task][b] is parked)
                xs.stop_after = None if needed or last_source is None else last_source
                with ctx.timed("block forwards"):
                    state = ctx.fetch(parked)
                    try:
                        out_student = ctx.park(ctx.forward(block, bi, state))
                    except StopForward:
                        out_student = None
                    xs.stop_after = None  # the merged-as-given stream below runs the block to its end
                    if calibrating and last_source is None and len(xs.order) == len(sources):
                        last_source = xs.order[-1]
                    if leaving:
                        out_expert = ctx.forward(expert_block, bi, ctx.fetch(streams.expert[task][b]))
                    else:  # statistics only: the expert's forward stops at the same module
                        xe.stop_after = last_source
                        try:
                            ctx.forward(expert_block, bi, ctx.fetch(streams.expert[task][b]))
                        except StopForward:
                            pass
                if calibrating:
                    with ctx.timed("statistics"):
                        accumulate(ctx, plan, statistics, xs, xe, state, targets, ye, from_outputs)
                if not leaving:
                    continue
                new_expert[task].append(ctx.park(out_expert))
                if new_given is not None:
                    # the merged model as given and the student coincide until a block is calibrated
                    new_given[task].append(out_student if given[task][b] is parked else None)
                if not calibrating:
                    new_student[task].append(out_student)
        for store in (xs, xe, ye):  # the last batch's captured tensors, consumed
            store.clear()
        if new_given is not None:
            # the merged-as-given stream once the capture hooks are gone: its forwards capture
            # nothing, and the captured inputs of the last batch are freed before they run
            with ctx.timed("drift (merged-as-given stream)"):
                new_given[task] = [
                    out if out is not None else ctx.run_block(block, bi, parked)
                    for out, parked in zip(new_given[task], given[task])
                ]
        if calibrating:
            with ctx.timed("statistics"):
                finish_task(ctx, statistics, expert_block, targets)
    if not leaving:
        return CapturedBlock(statistics, {}, None, None)
    return CapturedBlock(statistics, new_expert, new_given, None if calibrating else new_student)
