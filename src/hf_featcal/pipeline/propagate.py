"""Stage *propagate*: the student stream through the block, calibrated or left as it is, hooks off."""

from __future__ import annotations

import contextlib

from torch import nn

from .context import RunContext
from .plan import BlockPlan
from .streams import TaskStreams, let_go


def propagate(ctx: RunContext, block: nn.Module, plan: BlockPlan, student: TaskStreams) -> TaskStreams:
    """Every task's student batches through `block` (calibrated by now, or with nothing solved in it),
    parked for the next block. Each entering batch is let go as its new one is made (the task's list
    is taken out of `student` first), so the stream is held twice for one batch at a time, and the
    memory a batch leaves is there for the next new one (`student` is left empty)."""
    # a block with nothing solved runs as capture runs the expert's, in the layer map's capture
    # context: the student and expert streams of an unchanged block are computed alike
    alike = contextlib.nullcontext() if plan.calibrating else ctx.layer_map.capture_context(block)
    leaving: TaskStreams = {}
    with ctx.precision(), alike:
        for task in list(student):
            leaving[task] = [ctx.run_block(block, plan.block_index, state) for state in let_go(student.pop(task))]
            ctx.task_done()
    return leaving
