"""RegMean (Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language
Models"): each Linear inside the blocks is merged in closed form from every expert's input Gram,

    Wᵀ = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢᵀ,   G̃ᵢ = r·Gᵢ + (1 − r)·diag(Gᵢ),   Gᵢ = Σ_tokens w·x xᵀ,

where x is the Linear's input in expert i's own forward on task i's calibration data, w the token
weight (0 for padding; the layer map's rule, as for FeatCal) and r the reduction of the off-diagonal
entries. Every other parameter (biases, norms, embeddings, heads) is the plain average of the experts.

The Gram rule (`gram_rule`): ``"sum"`` (default) is the paper's formula above, Gᵢ = XᵢᵀXᵢ over all of
task i's tokens; ``"token_mean"`` divides it by nᵢ, the number of task i's tokens with nonzero weight
(padding does not count), as FusionBench's RegMean and the authors' code do. The two agree when every
task brings the same number of tokens (a common factor cancels in the solve) and differ otherwise:
``"sum"`` weighs a task by its token count, ``"token_mean"`` weighs tasks alike. FusionBench counts
every position of the Linear's input, padding included (its GPT-2 variant), a difference by design;
so is the set of Linears: FusionBench 0.2.33 solves every ``nn.Linear`` of the model, a causal LM's
``lm_head`` and a BERT model's pooler too, ours those inside the blocks (the paper's transformer layers),
those outside averaged.
With ``gram_rule="token_mean"`` the rest equals FusionBench's ``RegMeanAlgorithmForCLIP`` to float32
rounding (benchmarks/fusionbench_parity.py; docs/merge-methods.md).

It shares FeatCal's machinery: the layer map walks each expert's own stream block by block, its
capture helpers record the Linear inputs, and the solve is the library's symmetric solve; and the
calibrator's input checks (`hf_featcal.pipeline.checks`: tasks, configuration, batches, non-finite
features), run before the merge. It holds every expert in memory and, once they are computed, every
task's Grams of every Linear inside the blocks. The helpers below are shared with RegMean++
(`regmean_plusplus.py`), which takes the same Grams on the merged model's own stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..params import MergeMethod, MergeParameter
from ..registry import get_method, register
from .average import simple_average

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from ...architectures import LayerMap, ModuleSpec
    from ...data import Batch
    from ...pipeline.streams import StreamBatch

#: The Gram rules `gram_rule` takes: the paper's sum over tokens, or its mean per weighted token.
GRAM_RULES = ("sum", "token_mean")


def gram_rule_parameter(default: str) -> MergeParameter:
    """The declaration of `gram_rule` (RegMean and RegMean++ differ only in its default)."""
    return MergeParameter(
        "gram_rule", str, default, "each task's Gram: 'sum' Σ_tokens w·x xᵀ (RegMean paper), 'token_mean' the same "
        "divided by the task's number of tokens with nonzero weight (FusionBench, the authors' code)",
        choices=GRAM_RULES,
    )


def reduction_parameter(default: float) -> MergeParameter:
    """The declaration of `reduction`, r (RegMean and RegMean++ differ only in its default)."""
    return MergeParameter("reduction", float, default, "scale r of the Grams' off-diagonal entries",
                          interval=(0.0, 1.0, False, False))


def check_arguments(base_model: Any, experts: Any, calibration_data: Any, method: str) -> None:
    """The models and the data's shape, as `method` (its name in messages) needs them."""
    from torch import nn

    from ...pipeline.checks import check_tasks

    if not isinstance(base_model, nn.Module):
        raise TypeError(
            f"`base_model` must be a torch module (the skeleton of the merge), got {type(base_model).__name__}."
        )
    if not isinstance(experts, Mapping) or not experts:
        raise ValueError("`experts` must be a non-empty mapping of task name → expert model.")
    for task, expert in experts.items():
        if not isinstance(expert, nn.Module):
            raise TypeError(
                f"experts[{task!r}] must be an in-memory model for {method} (its own forward gives its Grams), "
                f"got {type(expert).__name__}."
            )
    if not isinstance(calibration_data, Mapping):
        raise TypeError("`calibration_data` must map each task to a datasets.Dataset or an iterable of batches.")
    check_tasks(experts, calibration_data)  # the calibrator's: every task has an expert and data


def prepare_calibration(
    function: str,
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    *,
    num_samples_per_task: int | None,
    batch_size: int,
    processing_class: Any,
    seed: int,
) -> dict[str, list[Batch]]:
    """Every task's calibration batches, after the calibrator's checks (the batching's ranges, empty
    tasks, batches the model cannot take); `function` names the caller in messages."""
    import torch

    from ...architectures import get_layer_map, model_config
    from ...config import FeatCalConfig
    from ...data import prepare_batches, text_length_limit
    from ...experts import module_device
    from ...parameters import ModelParameters
    from ...pipeline.checks import check_batches_enter_model, check_not_empty
    from ...pipeline.context import RunContext

    try:  # the same ranges as FeatCal's batching
        config = FeatCalConfig(num_samples_per_task=num_samples_per_task, batch_size=batch_size, seed=seed)
    except ValueError as err:
        raise ValueError(f"{function}: {err}") from None
    layer_map = get_layer_map(base_model, "base_model")
    max_length = text_length_limit(None, layer_map.tower_config(model_config(base_model)), processing_class)
    batches = {}
    for task in experts:
        batches[task] = prepare_batches(
            task, calibration_data[task], main_input_name=layer_map.main_input_name, num_samples=num_samples_per_task,
            batch_size=batch_size, seed=seed, processing_class=processing_class, max_length=max_length,
        )
        check_not_empty(task, batches[task])
    context = RunContext(
        model=base_model, layer_map=layer_map, config=config, parameters=ModelParameters(base_model), process=None,
        device=module_device(base_model), compute_dtype=torch.float64,
    )
    check_batches_enter_model(context, batches)
    return batches


def linear_specs(layer_map: LayerMap, block: nn.Module) -> list[ModuleSpec]:
    """The Linear specs of `block` (RegMean merges these; everything else is averaged)."""
    from ...architectures import LINEAR

    return [s for s in layer_map.block_modules(block) if s.kind == LINEAR]


def block_input_grams(
    layer_map: LayerMap, block: nn.Module, block_index: int, state: StreamBatch, dtype: torch.dtype
) -> tuple[dict[str, tuple[Tensor, int]], StreamBatch]:
    """`block` run on one stream batch: per Linear spec name, Σ w·x xᵀ of its input in `dtype` and the
    number of tokens with nonzero weight; and the stream's state after the block."""
    from ...hooks import capture_module_inputs

    specs = linear_specs(layer_map, block)
    with layer_map.capture_context(block), capture_module_inputs(block, sorted({s.capture for s in specs})) as store:
        after = layer_map.run_block(block, block_index, state)
    grams = {}
    for spec in specs:
        x = store[spec.capture].to(dtype)
        w = layer_map.input_weights(spec.name, state).to(device=x.device, dtype=dtype)
        x = x.reshape(-1, x.shape[-1])
        grams[spec.name] = ((x * w.reshape(-1, 1)).T @ x, int(w.count_nonzero()))
    return grams, after


def add_grams(
    sums: dict[Any, Tensor], tokens: dict[Any, int], block_grams: Mapping[str, tuple[Tensor, int]],
    key: Callable[[str], Any],
) -> None:
    """Add one batch's `block_input_grams` (per spec name: Gram sum, weighted tokens) into the running
    `sums` / `tokens`, under ``key(spec name)``."""
    for name, (gram, count) in block_grams.items():
        slot = key(name)
        sums[slot] = gram if slot not in sums else sums[slot] + gram
        tokens[slot] = count + tokens.get(slot, 0)


def features_where(task: str, block_index: int, stack_name: str, module: str) -> str:
    """How a non-finite Gram is named: the task's data entering the block's module."""
    return f"features of calibration_data[{task!r}] entering block {block_index} of {stack_name}, module {module}"


def finish_grams(sums: dict[Any, Tensor], tokens: dict[Any, int], gram_rule: str) -> dict[Any, Tensor]:
    """The Grams by `gram_rule` from their sums over the tokens and the counts of weighted tokens."""
    if gram_rule == "sum":
        return sums
    # a module whose every token weighs 0 has a zero Gram: it stays zero (no 0/0)
    return {key: gram / max(tokens[key], 1) for key, gram in sums.items()}


def expert_grams(
    expert: nn.Module, batches: Sequence[Mapping[str, Any]], *, dtype: torch.dtype | None = None,
    gram_rule: str = "sum",
) -> dict[tuple[int, int, str], Tensor]:
    """The Gram of the input of every Linear spec inside the blocks of `expert`, over its own forward
    on `batches`, in `dtype` (default float64), by `gram_rule` (Σ w·x xᵀ, or that over the number of
    tokens with nonzero weight); keyed by (stack, block, spec name)."""
    import torch

    from ...architectures import get_layer_map
    from ...hooks import eval_mode

    dtype = torch.float64 if dtype is None else dtype
    layer_map = get_layer_map(expert, "experts").for_batches({"task": list(batches)})
    tower = layer_map.tower(expert)
    sums: dict[tuple[int, int, str], Tensor] = {}
    tokens: dict[tuple[int, int, str], int] = {}
    with torch.no_grad(), eval_mode(expert):
        previous: list[Any] = [None] * len(batches)
        for si, stack in enumerate(layer_map.stacks(tower)):
            states = [layer_map.enter_stack(tower, b, si, previous[k]) for k, b in enumerate(batches)]
            for bi, block in enumerate(stack.blocks):

                def in_block(name: str, si: int = si, bi: int = bi) -> tuple[int, int, str]:
                    return (si, bi, name)

                for k, state in enumerate(states):
                    grams, states[k] = block_input_grams(layer_map, block, bi, state, dtype)
                    add_grams(sums, tokens, grams, in_block)
            previous = states
    return finish_grams(sums, tokens, gram_rule)


def solve_linear(
    block: nn.Module, spec: ModuleSpec, grams: Sequence[Tensor], expert_blocks: Sequence[nn.Module], reduction: float,
    where: str,
) -> None:
    """Write Wᵀ = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢᵀ into `spec` of `block`, G̃ᵢ = r·Gᵢ + (1 − r)·diag(Gᵢ), from each
    expert's Gram and its block; FloatingPointError naming `where` (method and block) for a
    non-finite solution."""
    import torch

    from ...solver import symmetric_solve

    lhs, rhs = None, None
    for gram, expert_block in zip(grams, expert_blocks, strict=True):
        g = reduction * gram + (1.0 - reduction) * torch.diag(gram.diagonal())
        weight = spec.value(expert_block).to(device=g.device, dtype=g.dtype)
        lhs = g if lhs is None else lhs + g
        rhs = g @ weight.T if rhs is None else rhs + g @ weight.T
    assert lhs is not None and rhs is not None  # there is at least one expert
    solution, _ = symmetric_solve(lhs, rhs)
    if not bool(torch.isfinite(solution).all()):
        raise FloatingPointError(f"{where}, {spec.name}: non-finite solution.")
    target = getattr(block.get_submodule(spec.owner), spec.weight_attr)
    rows = slice(None) if spec.rows is None else slice(*spec.rows)
    target.data[rows] = solution.T.to(dtype=target.dtype, device=target.device)


def regmean_merging(
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    *,
    reduction: float = 0.9,
    gram_rule: str = "sum",
    num_samples_per_task: int | None = 256,
    batch_size: int = 16,
    processing_class: Any = None,
    seed: int = 42,
) -> nn.Module:
    """Merge `experts` with RegMean; returns a new model of `base_model`'s class.

    Args:
        base_model: the skeleton (its class and config); with RegMean no weight of it is used.
        experts: task → in-memory expert model (the same architecture as `base_model`).
        calibration_data: task → a `datasets.Dataset` or an iterable of batches, as for FeatCal.
        reduction: r, the factor on the Grams' off-diagonal entries (1 keeps them; RegMean's default 0.9).
        gram_rule: ``"sum"`` (default; the paper's Gᵢ = Σ_tokens w·x xᵀ, the weights of earlier releases)
            or ``"token_mean"`` (Gᵢ divided by task i's number of tokens with nonzero weight, as
            FusionBench and the authors' code compute it); they differ when tasks bring different
            numbers of tokens.
        num_samples_per_task, batch_size, processing_class, seed: how calibration data is batched
            (as in `FeatCalConfig` / `FeatCalCalibrator`; texts truncated to the model's maximum).

    Raises:
        ValueError: before any Gram is computed, with the calibrator's checks and messages: a task
            without data or expert, an empty task, out-of-range `reduction` / `gram_rule` /
            `num_samples_per_task` / `batch_size`, batches the model cannot take, an expert of another
            configuration (fewer layers, other head count, ...); after the task's Grams, before any
            solve: non-finite features (`FeatCalError`, naming the task, block and module).
    """
    import torch

    from ...architectures import get_layer_map
    from ...pipeline.context import check_finite
    from ...progress import progress_bar
    from ..engine import record_merge

    check_arguments(base_model, experts, calibration_data, "RegMean")
    reduction, gram_rule = get_method("regmean").check(reduction=reduction, gram_rule=gram_rule)
    batches = prepare_calibration(
        "regmean_merging", base_model, experts, calibration_data, num_samples_per_task=num_samples_per_task,
        batch_size=batch_size, processing_class=processing_class, seed=seed,
    )
    layer_map = get_layer_map(base_model, "base_model")
    stack_names = [stack.name for stack in layer_map.stacks(layer_map.tower(base_model))]
    # the merge of the other parameters refuses experts of another configuration (the calibrator's
    # `check_compatible`), before any Gram
    merged = simple_average(base_model, experts)
    grams = {}
    for task, expert in progress_bar(experts.items(), total=len(experts), desc="RegMean: Grams", unit="expert"):
        grams[task] = expert_grams(expert, batches[task], gram_rule=gram_rule)
        for (si, bi, name), gram in grams[task].items():  # NaN features: named here, not by the solver
            check_finite(gram, features_where(task, bi, stack_names[si], name))
    towers = {task: layer_map.tower(expert) for task, expert in experts.items()}
    merged_tower = layer_map.tower(merged)
    with torch.no_grad():
        for si, stack in enumerate(layer_map.stacks(merged_tower)):
            expert_stacks = [layer_map.stacks(towers[t])[si] for t in experts]
            for bi, block in enumerate(stack.blocks):
                for spec in linear_specs(layer_map, block):
                    solve_linear(block, spec, [grams[t][(si, bi, spec.name)] for t in experts],
                                 [s.blocks[bi] for s in expert_stacks], reduction,
                                 f"RegMean, block {bi} of {stack.name}")
    record_merge(merged, {"method": "regmean", "reduction": reduction, "gram_rule": gram_rule,
                          "experts": list(experts)})
    return merged


METHOD = register(MergeMethod(
    "regmean", regmean_merging, summary="closed-form least squares per Linear from each expert's input Grams",
    reference="Jin et al., ICLR 2023, \"Dataless Knowledge Fusion by Merging Weights of Language Models\"; "
              "FusionBench fusion_bench.method.regmean.clip_regmean.RegMeanAlgorithmForCLIP",
    parameters=(reduction_parameter(0.9), gram_rule_parameter("sum")),
    paper_defaults={"reduction": 0.9, "gram_rule": "sum"}, needs_calibration_data=True,
    svc_alpha=0.1,  # no FusionBench SVC config: average's (RegMean averages the experts, least-squares-weighted)
))
