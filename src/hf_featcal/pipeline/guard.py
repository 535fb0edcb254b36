"""Stage *guard*: the held-out split of the calibration examples, and after a block is solved the blend
W(γ) = W_merged + γ·(W_calibrated − W_merged) of its solved parameters chosen on held-out drift
(`FeatCalConfig.heldout_fraction`, `guard`, `guard_gammas`).

For each γ of the grid the blend is written with the write stage (so offloaded and dispatched models
work as for the solutions themselves), the held-out student stream runs through the block, and each
task's held-out drift from its expert's block output is measured as the drift report measures what a
head reads (`drift.stream_drifts`' relative drift under the block's token weights: in a pooled stack's
last block the pooled token weighs 1 and the others `final_block_token_weight`), summed over
processes, so every process picks the same γ. γ = 1 is the calibrated block itself (its values are
written back unchanged: bit for bit the unguarded weights), γ = 0 the merged one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..data import Batch, batch_size_of, cut_batch, rest_of_batch
from .context import RunContext
from .drift import stream_drifts
from .plan import BlockPlan
from .streams import TaskStreams
from .write import BlockUpdates, read_spec, write_block


def split_heldout(
    batches: Mapping[str, list[Batch]], fraction: float, seed: int, main_input_name: str,
) -> tuple[dict[str, list[Batch]], dict[str, list[Batch]]]:
    """Each task's batches (every process's, before they are shared out) split into calibration and
    held-out batches: round(`fraction` × the task's examples) held out (at least one), taken as whole
    batches in an order drawn with `seed`, the last one cut: its first examples held out, the rest kept
    for calibration. Each part keeps the batches' order. ValueError naming
    `FeatCalConfig.heldout_fraction` where that would leave no example to calibrate on."""
    calibration, heldout = {}, {}
    for task, task_batches in batches.items():
        sizes = [batch_size_of(b, main_input_name) for b in task_batches]
        total = sum(sizes)
        wanted = max(1, round(fraction * total))
        if wanted >= total:
            raise ValueError(
                f"FeatCalConfig.heldout_fraction={fraction}: task {task!r} has {total} calibration example(s); "
                f"holding out {wanted} would leave none to calibrate on. Give more examples (num_samples_per_task) "
                "or a smaller heldout_fraction."
            )
        order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
        held: dict[int, int] = {}  # batch → how many of its first examples are held out
        count = 0
        for g in order:
            if count >= wanted:
                break
            held[g] = min(sizes[g], wanted - count)
            count += held[g]
        calibration[task] = [
            batch if g not in held else rest_of_batch(batch, sizes[g], held[g])
            for g, batch in enumerate(task_batches) if held.get(g, 0) < sizes[g]
        ]
        heldout[task] = [
            batch if held[g] == sizes[g] else cut_batch(batch, sizes[g], held[g])
            for g, batch in enumerate(task_batches) if g in held
        ]
    return calibration, heldout


def merged_values(ctx: RunContext, plan: BlockPlan, block: nn.Module) -> BlockUpdates:
    """A copy of the weight and bias (where there is one) of every module of the plan, as the block
    holds them now (before its solutions are written)."""
    values: BlockUpdates = {}
    for spec in plan.specs:
        values[spec.name] = {
            attr: read_spec(ctx.parameters, block, spec, attr).detach().clone()
            for attr in ("weight", "bias") if spec.value(block, attr) is not None
        }
    return values


def blend(merged: BlockUpdates, calibrated: BlockUpdates, gamma: float, dtype: torch.dtype) -> BlockUpdates:
    """W_merged + γ·(W_calibrated − W_merged) in `dtype` for every value of `calibrated`; γ = 1 gives
    the calibrated values and γ = 0 the merged ones themselves (no arithmetic: bit for bit)."""
    if gamma == 1:
        return calibrated
    if gamma == 0:
        return {name: {attr: merged[name][attr] for attr in values} for name, values in calibrated.items()}
    out: BlockUpdates = {}
    for name, values in calibrated.items():
        out[name] = {}
        for attr, value in values.items():
            start = merged[name][attr].to(device=value.device, dtype=dtype)
            out[name][attr] = start + gamma * (value.to(dtype) - start)
    return out


def choose_gamma(mode: str, gammas: Sequence[float], drifts: Mapping[str, Sequence[float]]) -> int:
    """The index of the γ the guard picks from each task's held-out drift at every γ of `gammas`
    (`gammas[0]` is 0, the reference): "no_rise", the largest γ at which no task's drift is above its
    value at γ = 0; "minimax", the γ minimising the largest ratio of a task's drift to its value at
    γ = 0 (ties: the larger γ; a task with no drift at γ = 0 counts 1 where it stays at 0, ∞ elsewhere)."""
    if mode == "no_rise":
        allowed = [i for i in range(len(gammas)) if all(d[i] <= d[0] for d in drifts.values())]
        return allowed[-1]  # γ = 0 always qualifies
    if mode == "minimax":
        def worst(i: int) -> float:
            return max((d[i] / d[0] if d[0] > 0 else (1.0 if d[i] == 0 else math.inf)) for d in drifts.values())

        scores = [worst(i) for i in range(len(gammas))]
        best = min(scores)
        return max(i for i, score in enumerate(scores) if score == best)
    raise ValueError(f"FeatCalConfig.guard must be 'no_rise' or 'minimax' to choose a γ, got {mode!r}.")


def guard_block(
    ctx: RunContext,
    plan: BlockPlan,
    block: nn.Module,
    merged: BlockUpdates,
    solved: Mapping[str, set[str]],
    heldout_student: TaskStreams,
    heldout_expert: TaskStreams,
) -> tuple[dict[str, Any], TaskStreams]:
    """Choose and write the block's blend. `merged`: `merged_values` taken before the block was solved;
    `solved`: module → the attributes its solutions wrote (the blend moves only those); the held-out
    streams entering the block (`heldout_student`, used up) and leaving the expert's block
    (`heldout_expert`). Returns the log entry (block, γ, the grid, per task the held-out drift at every
    γ) and the held-out student stream leaving the block at the chosen γ."""
    cfg = ctx.config
    where = ctx.where(plan.stack_index, plan.block_index)
    specs = {s.name: s for s in plan.specs}
    calibrated: BlockUpdates = {
        name: {attr: read_spec(ctx.parameters, block, specs[name], attr).detach().clone() for attr in sorted(attrs)}
        for name, attrs in solved.items()
    }
    gammas = [float(g) for g in cfg.guard_gammas]
    outputs: list[TaskStreams] = []
    with ctx.precision():
        for gamma in gammas:
            write_block(ctx.parameters, block, plan.specs, blend(merged, calibrated, gamma, ctx.compute_dtype), where)
            outputs.append({task: [ctx.run_block(block, plan.block_index, state) for state in states]
                            for task, states in heldout_student.items()})
    heldout_student.clear()
    drifts = {
        task: stream_drifts(ctx, [out[task] for out in outputs], heldout_expert[task], plan.pooled_token_index)[1]
        for task in heldout_expert
    }
    chosen = choose_gamma(cfg.guard, gammas, drifts)
    if chosen != len(gammas) - 1:  # the block holds the last γ's blend
        write_block(ctx.parameters, block, plan.specs, blend(merged, calibrated, gammas[chosen], ctx.compute_dtype),
                    where)
    ctx.logger.info("%s: held-out guard %r picks γ = %g (grid %s)", where, cfg.guard, gammas[chosen], gammas)
    entry = {"block": where, "gamma": gammas[chosen], "gammas": gammas, "heldout_head_drift": drifts}
    return entry, outputs[chosen]
