"""RegMean++ (Nguyen, Huu-Tien, Suzuki and Nguyen, 2025, "RegMean++: Enhancing Effectiveness and
Generalization of Regression Mean for Model Merging", arXiv:2508.03121): RegMean whose Grams are taken
on the merged model's own stream, block by block. For block b and task i,

    Wᵀ = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢᵀ,   G̃ᵢ = r·Gᵢ + (1 − r)·diag(Gᵢ),   Gᵢ = (1/nᵢ) Σ_tokens w·x xᵀ,

where x is the Linear's input when task i's calibration data runs through the merged model up to
block b (its averaged embeddings and its blocks 0..b−1, already merged) and then through expert i's
own block b; w is the token weight (0 for padding; the layer map's rule, as for FeatCal), nᵢ the
number of task i's tokens with nonzero weight (`gram_rule="token_mean"`, the default; ``"sum"`` drops
the 1/nᵢ, RegMean's formula) and r the reduction of the off-diagonal entries. Once block b's Linears
are solved, every task's merged stream runs through the merged block b and goes on to block b+1
(through a stack boundary, as the merged model's own forward does). Every other parameter (biases,
norms, embeddings, heads) is the plain average of the experts, as in RegMean.

Defaults: `reduction` 0.95 and `gram_rule` ``"token_mean"``, those of FusionBench's
`RegMeanAlgorithmForCLIPPlusPlus` (config ``method/regmean_plusplus/clip_regmean_plusplus.yaml``),
which is the authors' code: its per-token mean is how the paper's numbers were computed.

Reference: FusionBench 0.2.33, `fusion_bench.method.regmean_plusplus` (`RegMeanAlgorithmPlusPlus`,
`RegMeanAlgorithmForCLIPPlusPlus`). The same algorithm, with these differences by design:
- FusionBench's CLIP variant averages only the embeddings, the pre-norm and the encoder layers; the
  final `post_layernorm` stays the pretrained model's. Here every parameter outside the Linears is the
  experts' average (as RegMean, FusionBench's RegMean included, merges it).
- FusionBench implements CLIP vision only; here every architecture with a layer map (and every stack,
  e.g. T5's encoder then decoder).
- FusionBench's token count takes every position of the Linear's input; here tokens with weight 0
  (padding, labels −100) neither enter the Gram nor the count. Images have no padding: the same there.
- Grams accumulate in float64 and the system is solved by Cholesky; FusionBench keeps a running mean
  in the model's dtype (float32) and inverts with `torch.inverse`: results agree to float32 rounding.
- The calibration examples are drawn as for FeatCal (`num_samples_per_task` with `seed`); FusionBench
  takes the first whole batches of a shuffled loader until 256 examples are reached.

Memory: every expert in memory (their blocks give the Grams), every task's merged stream between two
blocks (as FeatCal's student stream), and all tasks' Grams of one block at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..params import MergeMethod
from ..registry import get_method, register
from .average import simple_average
from .regmean import (
    add_grams,
    block_input_grams,
    check_arguments,
    features_where,
    finish_grams,
    gram_rule_parameter,
    linear_specs,
    prepare_calibration,
    reduction_parameter,
    solve_linear,
)

if TYPE_CHECKING:
    from torch import nn


def regmean_plusplus_merging(
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    *,
    reduction: float = 0.95,
    gram_rule: str = "token_mean",
    num_samples_per_task: int | None = 256,
    batch_size: int = 16,
    processing_class: Any = None,
    seed: int = 42,
) -> nn.Module:
    """Merge `experts` with RegMean++; returns a new model of `base_model`'s class.

    Args:
        base_model: the skeleton (its class and config); no weight of it is used.
        experts: task → in-memory expert model (the same architecture as `base_model`).
        calibration_data: task → a `datasets.Dataset` or an iterable of batches, as for FeatCal.
        reduction: r, the factor on the Grams' off-diagonal entries (1 keeps them; FusionBench's 0.95).
        gram_rule: ``"token_mean"`` (default; each task's Gram divided by its number of tokens with
            nonzero weight, as FusionBench / the authors compute it: tasks weigh alike) or ``"sum"``
            (RegMean's Σ_tokens w·x xᵀ: a task weighs by its token count).
        num_samples_per_task, batch_size, processing_class, seed: how calibration data is batched
            (as in `FeatCalConfig` / `FeatCalCalibrator`; texts truncated to the model's maximum).

    Raises:
        ValueError: before any Gram is computed, as `regmean_merging` does (tasks, out-of-range
            parameters, empty tasks, batches the model cannot take, experts of another
            configuration); non-finite features when a block's Grams are taken (`FeatCalError`,
            naming the task, block and module), before that block is solved.
    """
    import torch
    from accelerate.utils import send_to_device

    from ...architectures import get_layer_map
    from ...experts import module_device
    from ...hooks import eval_mode
    from ...pipeline.context import check_finite
    from ..engine import record_merge

    check_arguments(base_model, experts, calibration_data, "RegMean++")
    reduction, gram_rule = get_method("regmean_plusplus").check(reduction=reduction, gram_rule=gram_rule)
    batches = prepare_calibration(
        "regmean_plusplus_merging", base_model, experts, calibration_data, num_samples_per_task=num_samples_per_task,
        batch_size=batch_size, processing_class=processing_class, seed=seed,
    )
    # the average gives every parameter outside the Linears (and refuses experts of another configuration);
    # its Linears inside the blocks are overwritten block by block below, before the stream reaches them
    merged = simple_average(base_model, experts)
    layer_map = get_layer_map(merged, "base_model").for_batches(batches)
    tower = layer_map.tower(merged)
    expert_stacks = {task: layer_map.stacks(layer_map.tower(expert)) for task, expert in experts.items()}
    device = module_device(merged)
    with torch.no_grad(), eval_mode(merged, *experts.values()):
        previous: dict[str, list[Any]] = {task: [None] * len(batches[task]) for task in experts}
        for si, stack in enumerate(layer_map.stacks(tower)):
            streams = {
                task: [layer_map.enter_stack(tower, send_to_device(b, device), si, previous[task][k])
                       for k, b in enumerate(batches[task])]
                for task in experts
            }
            for bi, block in enumerate(stack.blocks):
                grams = {}
                for task, states in streams.items():
                    expert_block = expert_stacks[task][si].blocks[bi]
                    expert_device = module_device(expert_block)
                    sums: dict[str, torch.Tensor] = {}
                    tokens: dict[str, int] = {}
                    for state in states:  # the merged stream into expert i's own block b
                        block_grams, _ = block_input_grams(layer_map, expert_block, bi, state.to(expert_device),
                                                           torch.float64)
                        add_grams(sums, tokens, block_grams, str)
                    grams[task] = finish_grams(sums, tokens, gram_rule)
                    for name, gram in grams[task].items():  # NaN features: named here, not by the solver
                        check_finite(gram, features_where(task, bi, stack.name, name))
                for spec in linear_specs(layer_map, block):
                    solve_linear(block, spec, [grams[t][spec.name].to(device) for t in experts],
                                 [expert_stacks[t][si].blocks[bi] for t in experts], reduction,
                                 f"RegMean++, block {bi} of {stack.name}")
                del grams
                streams = {task: [layer_map.run_block(block, bi, state) for state in states]
                           for task, states in streams.items()}
            previous = streams
    record_merge(merged, {"method": "regmean_plusplus", "reduction": reduction, "gram_rule": gram_rule,
                          "experts": list(experts)})
    return merged


METHOD = register(MergeMethod(
    "regmean_plusplus", regmean_plusplus_merging,
    summary="RegMean with each block's Grams taken on the merged model's own stream, block by block",
    reference="Nguyen et al., 2025, \"RegMean++: Enhancing Effectiveness and Generalization of Regression Mean "
              "for Model Merging\" (arXiv:2508.03121); FusionBench fusion_bench.method.regmean_plusplus",
    parameters=(reduction_parameter(0.95), gram_rule_parameter("token_mean")),
    paper_defaults={"reduction": 0.95, "gram_rule": "token_mean"}, needs_calibration_data=True,
    svc_alpha=0.1,  # no FusionBench SVC config: average's, as RegMean
))
