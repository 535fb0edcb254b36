"""Stage *accumulate*: per-task weighted sums of one block's captured module inputs, folded into
task sums at the end of each task (the accumulators are in `hf_featcal.statistics`). Capture drives
one `TaskPass` per task: begun with the task's expert block, fed each captured batch, finished."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..architectures import LAYER_NORM, ModuleSpec
from ..statistics import LinearGroupStatistics, LinearTargets, NormStatistics, PooledWeighting
from .context import RunContext
from .plan import BlockPlan
from .streams import StreamBatch


@dataclass
class BlockStatistics:
    """The accumulators of one block: per statistics group of Linears, and per norm."""

    # (captured input, pooled-token weighting, weight source) → the group's accumulator
    linear: dict[tuple[str, bool, str], LinearGroupStatistics] = field(default_factory=dict)
    # (norm module, pooled-token weighting) → its accumulator
    norms: dict[tuple[str, bool], NormStatistics] = field(default_factory=dict)


def new_statistics(ctx: RunContext, plan: BlockPlan, block: nn.Module) -> BlockStatistics:
    """Empty accumulators for every statistics group of the block's plan."""
    kw: dict[str, Any] = {"dtype": ctx.compute_dtype, "device": ctx.device}
    linear = {}
    specs = {s.name: s for s in plan.specs}
    for key, names in plan.linear_groups.items():
        dim = specs[names[0]].shape(block)[1]
        outputs = sum(specs[n].shape(block)[0] for n in names)
        pooled = None
        if key[1]:  # weighted: a pooled-head stack's last block
            assert plan.pooled_token_index is not None  # only such a block weights its tokens
            pooled = PooledWeighting(plan.pooled_token_index, ctx.config.final_block_token_weight)
        linear[key] = LinearGroupStatistics(
            tuple(names), dim, epsilon=ctx.config.epsilon, direct_rhs=outputs < dim, product_dtype=ctx.forward_dtype,
            teacher_alpha=ctx.config.teacher_alpha, pooled=pooled, **kw
        )
    for (source, weighted, weight_source), stats in linear.items():
        # q beside k/v: the same input, one group weighted and one not; without right-hand sides of their
        # own modules in the running sums (`direct_rhs`), the weighted group's every-token sums are the other's
        main = linear.get((source, False, weight_source))
        if weighted and main is not None and not stats.direct_rhs and not main.direct_rhs:
            stats.main_from = main
    norms = {}
    for name, weighted in plan.norms:
        module: Any = block.get_submodule(name)  # Any: a norm's weight, by its class
        kind = next(s.kind for s in plan.specs if s.name == name)
        norms[(name, weighted)] = NormStatistics(
            name, module.weight.shape[0], centered=kind == LAYER_NORM, norm_eps=ctx.layer_map.norm_eps(module), **kw
        )
    return BlockStatistics(linear, norms)


def expert_targets(plan: BlockPlan, statistics: BlockStatistics, expert_block: nn.Module) -> dict[str, LinearTargets]:
    """The task expert's parameters of every Linear being solved."""
    specs = {s.name: s for s in plan.specs}
    return {
        name: LinearTargets(specs[name].value(expert_block, "weight"), specs[name].value(expert_block, "bias"))
        for stats in statistics.linear.values()
        for name in stats.modules
    }


def output_groups(
    ctx: RunContext, plan: BlockPlan, statistics: BlockStatistics, expert_block: nn.Module, batches: list[StreamBatch]
) -> dict[tuple[str, bool, str], tuple[str, ...]]:
    """The statistics groups whose right-hand sides one task takes from the expert modules' own
    outputs (`LinearGroupStatistics.expert_outputs_pay`, for the task's weighted tokens in `batches`,
    its student stream), each with its modules. Only whole `nn.Linear` modules qualify, whose output
    is W x + b of the very weight solved for, in the statistics' dtype."""
    specs = {s.name: s for s in plan.specs}
    chosen = {}
    for key, stats in statistics.linear.items():
        if not stats.direct_rhs or not all(_plain_linear(specs[n], expert_block, stats.dtype) for n in stats.modules):
            continue
        tokens = sum(int((module_weights(ctx, plan, stats.modules[0], key[1], b) > 0).sum()) for b in batches)
        if stats.expert_outputs_pay(tokens, ctx.config.teacher_alpha):
            chosen[key] = stats.modules
    return chosen


def _plain_linear(spec: ModuleSpec, block: nn.Module, dtype: torch.dtype) -> bool:
    if spec.rows is not None or spec.module is not None or spec.reads is not None or spec.weight_attr != "weight":
        return False
    module = block.get_submodule(spec.name)
    forward = module.__dict__.get("forward")  # an instance forward only if it is Linear's own (hooks removed)
    own = forward is None or (getattr(forward, "__func__", None) is nn.Linear.forward and forward.__self__ is module)
    return type(module) is nn.Linear and own and module.weight.dtype == dtype


def accumulate(
    ctx: RunContext,
    plan: BlockPlan,
    statistics: BlockStatistics,
    xs: Mapping[str, Tensor],
    xe: Mapping[str, Tensor],
    state: StreamBatch,
    targets: dict[str, LinearTargets],
    ye: Mapping[str, Tensor] | None = None,
    from_outputs: Mapping[tuple[str, bool, str], tuple[str, ...]] | None = None,
) -> None:
    """Add one batch: student inputs `xs`, expert inputs `xe` (by captured module), the student's
    stream batch `state` (its token weights); for the groups in `from_outputs` (`output_groups`),
    the expert modules' outputs `ye`."""
    alpha = ctx.config.teacher_alpha
    for key, stats in statistics.linear.items():
        source = key[0]
        # the tokens' own weights: a weighted group applies the pooled-token weighting itself (`pooled`)
        weights = ctx.layer_map.input_weights(stats.modules[0], state)
        outputs = None
        if from_outputs and key in from_outputs:
            assert ye is not None  # the expert's outputs are captured for these groups
            outputs = {name: ye[name] for name in stats.modules}
        stats.accumulate_mixture(xs[source], xe[source], alpha, weights, targets, outputs)
    for (name, weighted), norm in statistics.norms.items():
        norm.accumulate(xs[name], module_weights(ctx, plan, name, weighted, state))


def module_weights(ctx: RunContext, plan: BlockPlan, name: str, weighted: bool, state: StreamBatch) -> Tensor:
    """Token weights of a module's input: padding 0, and in the last block of a pooled-head stack
    `final_block_token_weight` for every token but the pooled one (unless a key/value projection)."""
    weights = ctx.layer_map.input_weights(name, state)
    if not weighted:
        return weights
    assert plan.pooled_token_index is not None  # only a pooled stack's last block weights its tokens
    return pooled_weighting(weights, plan.pooled_token_index, ctx.config.final_block_token_weight)


def pooled_weighting(weights: Tensor, pooled_token_index: int, other_token_weight: float) -> Tensor:
    """Token weights (B, N) with every token but the pooled one scaled by `other_token_weight`."""
    factor = torch.full_like(weights, other_token_weight)
    factor[:, pooled_token_index] = 1.0
    return weights * factor


@dataclass
class TaskPass:
    """One task's pass over a block: the expert's parameters solved towards (`targets`), the groups
    whose right-hand sides come from the expert modules' outputs (`from_outputs`), and the block's
    statistics each captured batch is added to."""

    ctx: RunContext
    plan: BlockPlan
    statistics: BlockStatistics
    expert_block: nn.Module
    targets: dict[str, LinearTargets]
    from_outputs: dict[tuple[str, bool, str], tuple[str, ...]]
    #: the task's weight ω_i in the joint objective (`RunContext.task_weights`)
    weight: float = 1.0

    @classmethod
    def begin(
        cls, ctx: RunContext, plan: BlockPlan, statistics: BlockStatistics, expert_block: nn.Module,
        student: list[StreamBatch] | None, task: str | None = None,
    ) -> TaskPass:
        """`student`: the task's student stream, where the expert modules' outputs may be captured
        (None: a statistics-only pass, whose expert forward stops before them); `task`: whose pass it
        is (its weight; None: weight 1)."""
        targets = expert_targets(plan, statistics, expert_block)
        from_outputs = {} if student is None else output_groups(ctx, plan, statistics, expert_block, student)
        weight = 1.0 if task is None else ctx.task_weights.get(task, 1.0)
        return cls(ctx, plan, statistics, expert_block, targets, from_outputs, weight)

    @property
    def output_modules(self) -> set[str]:
        """The expert modules whose outputs `add` needs."""
        return {name for names in self.from_outputs.values() for name in names}

    def add(self, xs: Mapping[str, Tensor], xe: Mapping[str, Tensor], state: StreamBatch,
            ye: Mapping[str, Tensor]) -> None:
        """One captured batch (see `accumulate`)."""
        accumulate(self.ctx, self.plan, self.statistics, xs, xe, state, self.targets, ye, self.from_outputs)

    def finish(self) -> None:
        """The task's sums folded into the task sums (see `finish_task`)."""
        finish_task(self.ctx, self.statistics, self.expert_block, self.targets, self.weight)


def finish_task(ctx: RunContext, statistics: BlockStatistics, expert_block: nn.Module,
                targets: dict[str, LinearTargets], task_weight: float = 1.0) -> None:
    """Fold the task's sums (reduced across processes) into the task sums, its terms weighted by
    `task_weight`."""
    # a group reading another's running sums (`main_from`) is folded before that group resets them
    for stats in sorted(statistics.linear.values(), key=lambda group: group.main_from is None):
        stats.finish_task(targets, ctx.reduce, task_weight)
    for (name, _), norm in statistics.norms.items():
        module: Any = expert_block.get_submodule(name)  # Any: a norm's weight and bias, by its class
        norm.finish_task(module.weight.detach(), getattr(module, "bias", None), ctx.reduce, task_weight)
