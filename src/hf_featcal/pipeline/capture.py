"""Stage *capture*: run one block on every task's student and expert streams with hooks on the
modules being calibrated, and hand each batch's captured inputs to the accumulators."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from torch import nn

from ..experts import ModelSource
from ..hooks import capture_module_inputs, capture_module_outputs, eval_mode
from .accumulate import BlockStatistics, TaskPass, new_statistics
from .context import RunContext
from .plan import BlockPlan
from .streams import StopForward, StreamBatch, Streams, TaskStreams, let_go


@dataclass
class CapturedBlock:
    """What one pass over a block leaves: the folded statistics (empty when nothing is solved) and the
    expert stream leaving the block (empty for a statistics-only pass). The student stream leaving
    the block is `propagate`'s, the merged-as-given one `drift.advance_given`'s."""

    statistics: BlockStatistics
    expert: TaskStreams
    heldout_expert: TaskStreams | None = None
    #: task → batch index → the student batch leaving the block as given, for the batches whose
    #: student forward was asked to run to the end (`capture_block`'s `whole`)
    student_as_given: dict[str, dict[int, StreamBatch]] = field(default_factory=dict)


def capture_block(
    ctx: RunContext,
    plan: BlockPlan,
    block: nn.Module,
    streams: Streams,
    experts: Mapping[str, ModelSource],
    note: Callable[[str], None] = lambda _: None,
    leaving: bool = True,
    release: bool = False,
    heldout_expert: TaskStreams | None = None,
    whole: Mapping[str, Collection[int]] | None = None,
) -> CapturedBlock:
    """One pass of every task's streams through the block (the merged `block` on the student stream,
    the task expert's on the expert stream), accumulating statistics per task; `note` receives
    progress messages. With nothing to solve here only the expert stream runs.

    With `leaving=False` (a later step of module granularity, `pipeline/steps.py`) only the
    statistics are wanted: both forwards stop once the plan's inputs are captured, and the expert
    stream leaving the block is not computed.

    With `release` (no later pass reads the expert stream entering the block), each entering expert
    batch is dropped from `streams.expert` once it has been through the block (the task's list goes
    once its pass is over): the stream is then held twice for one batch at a time, not for a task's
    batches or all of them, and the memory a batch leaves is there for the next batch's new one.

    With `heldout_expert` (the held-out examples' expert stream entering the block; only with
    `leaving`), it runs through the task's expert block after the calibration batches, with no capture
    hooks, as the calibration expert stream does (`release` drops its entering batches as well).

    With `whole` (task → indices of student batches), those batches' student forwards run to the
    block's end, and what leaves the block (the merged block as given, before anything is solved) is
    kept in `CapturedBlock.student_as_given`: the drift report's merged-as-given stream, where it is
    still the student's, needs no forward of its own."""
    lm, bi = ctx.layer_map, plan.block_index
    calibrating = plan.calibrating
    statistics = new_statistics(ctx, plan, block) if calibrating else BlockStatistics()
    sources = plan.capture_sources
    last_source: str | None = None  # the last captured module in forward order, once seen
    assert streams.student is not None and streams.expert is not None  # the block's entering streams
    new_expert: TaskStreams = {}
    new_heldout: TaskStreams | None = None if heldout_expert is None else {}
    as_given: dict[str, dict[int, StreamBatch]] = {}
    for task, source in experts.items():
        note(f"{'collecting statistics' if calibrating else 'forwarding'} · {task}")
        with ctx.timed("loading expert blocks"):
            expert_block = source.block(ctx.model, plan.stack_index, bi, ctx.device)
            # (a statistics-only pass stops the expert's forward before the last module's output)
            sums = TaskPass.begin(ctx, plan, statistics, expert_block, streams.student[task] if leaving else None,
                                  task)
        new_expert[task] = []
        with (
            ctx.precision(),
            eval_mode(expert_block),
            lm.capture_context(block),
            lm.capture_context(expert_block),
            capture_module_inputs(block, sources) as xs,
            capture_module_inputs(expert_block, sources) as xe,
            capture_module_outputs(expert_block, sums.output_modules) as ye,
        ):
            entering = let_go(streams.expert.pop(task)) if release else streams.expert[task]
            for b, expert_batch in enumerate(entering):
                state = None
                with ctx.timed("block forwards"):
                    if calibrating:
                        # the student's forward stops once the last module input is captured (its
                        # stream leaving the block is propagated through the calibrated block), but
                        # for the batches in `whole`, whose output as given is kept
                        to_the_end = whole is not None and b in whole.get(task, ())
                        xs.stop_after = None if to_the_end else last_source
                        state = ctx.fetch(streams.student[task][b])
                        try:
                            leaving_block = ctx.forward(block, bi, state)
                            if to_the_end:
                                as_given.setdefault(task, {})[b] = ctx.park(leaving_block)
                            del leaving_block
                        except StopForward:
                            pass
                        if last_source is None and len(xs.order) == len(sources):
                            last_source = xs.order[-1]
                    if leaving:
                        new_expert[task].append(ctx.park(ctx.forward(expert_block, bi, ctx.fetch(expert_batch))))
                        del expert_batch
                    else:  # statistics only: the expert's forward stops at the same module
                        xe.stop_after = last_source
                        try:
                            ctx.forward(expert_block, bi, ctx.fetch(expert_batch))
                        except StopForward:
                            pass
                if calibrating:
                    assert state is not None  # the student's batch, fetched above when calibrating
                    with ctx.timed("statistics"):
                        sums.add(xs, xe, state, ye)
        for store in (xs, xe, ye):  # the last batch's captured tensors, consumed
            store.clear()
        if heldout_expert is not None:
            assert leaving and new_heldout is not None  # a statistics-only pass leaves no stream
            with (ctx.precision(), eval_mode(expert_block), lm.capture_context(expert_block),
                  ctx.timed("block forwards")):
                new_heldout[task] = [ctx.run_block(expert_block, bi, state) for state in heldout_expert[task]]
            if release:
                del heldout_expert[task]
        if calibrating:
            with ctx.timed("statistics"):
                sums.finish()
        ctx.task_done()
    return CapturedBlock(statistics, new_expert, new_heldout, as_given)
