"""Stage *steps* (module granularity, `FeatCalConfig.granularity="module"`): one block's plan split
into solve steps in forward order.

A step is every selected module that reads one captured input (a norm; q/k/v; gate/up; the rows of a
packed in-projection), so modules sharing an input are solved together. The forward order is the
order in which the capture hooks fire on one student batch — not the modules' names. Each later
step's statistics come from a new pass over the block in which the earlier steps are already written
(the student's inputs change; the expert's do not).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..hooks import capture_module_inputs
from .context import FeatCalError, RunContext
from .plan import BlockPlan
from .streams import Streams


def forward_order(ctx: RunContext, plan: BlockPlan, block: nn.Module, streams: Streams) -> list[str]:
    """The plan's captured inputs in the order their hooks fire, from one student batch through the
    (not yet calibrated) block. Every process uses the main process's order (the main process holds
    a batch of every task)."""
    lm, sources = ctx.layer_map, plan.capture_sources
    assert streams.student is not None  # the block's entering streams
    batch = next((states[0] for states in streams.student.values() if states), None)
    order: list[str] | None = None
    if batch is not None:
        with lm.capture_context(block), capture_module_inputs(block, sources) as xs:
            ctx.forward(block, plan.block_index, ctx.fetch(batch))
        order = list(xs.order)
    if ctx.process.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        order = broadcast_object_list([order], from_process=0)[0]
    missing = sorted(set(sources) - set(order or ()))
    if missing:
        raise FeatCalError(
            f"FeatCalConfig.granularity='module': in {ctx.where(plan.stack_index, plan.block_index)} the inputs of "
            f"{missing} were not seen in a forward pass, so their order is unknown."
        )
    assert order is not None  # no source is missing
    return order


def module_steps(plan: BlockPlan, order: list[str]) -> list[BlockPlan]:
    """The plan split by captured input, in `order`: one sub-plan per step, with the same block,
    pooled-token weighting and statistics groups as the whole plan."""
    steps = []
    for source in dict.fromkeys(order):
        groups = {key: names for key, names in plan.linear_groups.items() if key[0] == source}
        norms = [(name, weighted) for name, weighted in plan.norms if name == source]
        if not groups and not norms:
            continue
        names = {n for members in groups.values() for n in members} | {name for name, _ in norms}
        specs = [s for s in plan.specs if s.name in names]
        steps.append(replace(plan, specs=specs, linear_groups=groups, norms=norms))
    return steps
