"""Stage *solve*: every selected module of one block in closed form, from its folded statistics,
towards the anchor (the closed forms themselves are in `hf_featcal.solver`)."""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from ..solver import (
    SINGULAR_RTOL,
    anchor,
    gram_is_singular,
    linear_objective_decrease,
    ridge_settles_null_directions,
    solve_layer_norm,
    solve_linear_bias,
    solve_linear_weights,
    solve_scale_only_norm,
)
from .accumulate import BlockStatistics
from .context import FeatCalWarning, RunContext, check_finite, user_stacklevel
from .plan import BlockPlan
from .write import BlockUpdates, read_spec


def solve_block(
    ctx: RunContext, plan: BlockPlan, block: nn.Module, statistics: BlockStatistics, base_block: nn.Module | None
) -> BlockUpdates:
    """The new weight (and bias) of every module of the plan, anchored between the merged block's and
    `base_block`'s (the base model's block on the device; None: at the merged weights); each Linear's
    solve is logged in `ctx.solve_log`. Raises FeatCalError on non-finite features."""
    cfg = ctx.config
    lam, eps, rho = cfg.lambda_ratio, cfg.epsilon, cfg.anchor_rho
    linear, norms = statistics.linear, statistics.norms
    where = ctx.where(plan.stack_index, plan.block_index)

    specs = {s.name: s for s in plan.specs}

    def anchor_of(name: str, attr: str) -> Tensor:
        merged = read_spec(ctx.parameters, block, specs[name], attr).to(ctx.device, ctx.compute_dtype)
        base = None
        if base_block is not None:
            base = specs[name].value(base_block, attr).to(device=merged.device, dtype=ctx.compute_dtype)
        return anchor(merged, base, rho)

    updates: BlockUpdates = {}
    for stats in linear.values():
        names = list(stats.modules)
        assert stats.gram_sum is not None and stats.student_mean_sum is not None  # summed over the tasks
        work = ctx.workspace(stats.gram_sum)  # the singularity test's and the solve's factorisations
        check_finite(stats.gram_sum, f"features entering {where}, module {', '.join(names)}")
        # tokens counted by their weights: the pooled last block's other tokens (weight 0.01) add
        # almost nothing to the Gram, however many there are
        if stats.effective_tokens < stats.dim:
            warnings.warn(
                f"{where}, modules {names}: {stats.effective_tokens:.4g} weighted tokens for input dimension "
                f"{stats.dim} (each token counted by its weight, summed over tasks); the solution there is "
                "set by the ridge: give more calibration examples.",
                FeatCalWarning,
                stacklevel=user_stacklevel(),
            )
        elif (not ridge_settles_null_directions(stats.gram_sum, lam + eps)
              and gram_is_singular(stats.gram_sum, work=work)):
            warnings.warn(
                f"{where}, modules {names}: the input Gram is numerically singular and λ + ε = {lam + eps:.3g} is "
                f"below {SINGULAR_RTOL:g} of its norm: the solution in its null directions is set by ε and "
                "round-off, not by the data or the anchor; raise lambda_ratio.",
                FeatCalWarning,
                stacklevel=user_stacklevel(),
            )
        weights, info = solve_linear_weights(
            stats.gram_sum, [stats.rhs_sum[name] for name in names], [anchor_of(name, "weight") for name in names],
            lam, eps,
            work=work,
        )
        for name, weight in zip(names, weights, strict=True):
            old = read_spec(ctx.parameters, block, specs[name], "weight").to(ctx.device)
            decrease = linear_objective_decrease(stats.gram_sum, old, weight, lam, eps, factor=info.factor)
            ctx.solve_log.append(
                {"block": where, "module": name, "method": info.method, "damping": info.damping,
                 "objective_decrease": decrease}
            )
            ctx.logger.info(
                "%s %s: objective J(merged) − J(calibrated) = %.4g (%s%s)", where, name, decrease, info.method,
                f", damping {info.damping:.3g}" if info.damping else "",
            )
            update = {"weight": weight}
            if specs[name].value(block, "bias") is not None and cfg.calibrate_bias:
                update["bias"] = solve_linear_bias(
                    weight, stats.bias_target_sum[name], stats.student_mean_sum, stats.scale_sum,
                    anchor_of(name, "bias"), lam,
                )
            updates[name] = update
    for (name, _), norm in norms.items():
        module = block.get_submodule(name)
        assert norm.second_moment_sum is not None and norm.gamma_target_sum is not None  # summed over tasks
        check_finite(norm.second_moment_sum, f"features entering {where}, module {name}")
        has_bias = getattr(module, "bias", None) is not None
        if norm.centered and has_bias:
            # the experts' norms have the merged one's bias
            assert norm.mean_sum is not None and norm.beta_target_sum is not None
            gamma, beta = solve_layer_norm(
                norm.second_moment_sum, norm.mean_sum, norm.gamma_target_sum, norm.beta_target_sum,
                norm.task_weight_sum, anchor_of(name, "weight"), anchor_of(name, "bias"), lam, eps,
            )
            updates[name] = {"weight": gamma, "bias": beta}
        else:
            updates[name] = {
                "weight": solve_scale_only_norm(norm.second_moment_sum, norm.gamma_target_sum,
                                                anchor_of(name, "weight"), lam, eps)
            }
    return updates
