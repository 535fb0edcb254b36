"""Stage *propagate*: the student stream through the calibrated block, hooks off."""

from __future__ import annotations

from torch import nn

from .context import RunContext
from .streams import TaskStreams


def propagate(ctx: RunContext, block: nn.Module, block_index: int, student: TaskStreams) -> TaskStreams:
    """Every task's student batches through `block` (already calibrated), parked for the next block."""
    with ctx.precision():
        return {task: [ctx.run_block(block, block_index, state) for state in states] for task, states in student.items()}
