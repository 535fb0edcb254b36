"""RegMean (Jin et al., ICLR 2023, "Dataless Knowledge Fusion by Merging Weights of Language
Models"): each Linear inside the blocks is merged in closed form from every expert's input Gram,

    Wᵀ = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢᵀ,   G̃ᵢ = r·Gᵢ + (1 − r)·diag(Gᵢ),   Gᵢ = Σ_tokens w·x xᵀ,

where x is the Linear's input in expert i's own forward on task i's calibration data, w the token
weight (0 for padding; the layer map's rule, as for FeatCal) and r the reduction of the off-diagonal
entries. Every other parameter (biases, norms, embeddings, heads) is the plain average of the experts.

It shares FeatCal's machinery: the layer map walks each expert's own stream block by block, its
capture helpers record the Linear inputs, and the solve is the library's symmetric solve; and the
calibrator's input checks (`hf_featcal.pipeline.checks`: tasks, configuration, batches, non-finite
features), run before the merge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..params import MergeMethod, MergeParameter
from ..registry import get_method, register
from .average import simple_average

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn


def _check_arguments(base_model: Any, experts: Any, calibration_data: Any) -> None:
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
                f"experts[{task!r}] must be an in-memory model for RegMean (its own forward gives its Grams), "
                f"got {type(expert).__name__}."
            )
    if not isinstance(calibration_data, Mapping):
        raise TypeError("`calibration_data` must map each task to a datasets.Dataset or an iterable of batches.")
    check_tasks(experts, calibration_data)  # the calibrator's: every task has an expert and data


def expert_grams(
    expert: nn.Module, batches: Sequence[Mapping[str, Any]], *, dtype: torch.dtype | None = None
) -> dict[tuple[int, int, str], Tensor]:
    """Σ w·x xᵀ of the input of every Linear spec inside the blocks of `expert`, over its own forward
    on `batches`, in `dtype` (default float64); keyed by (stack, block, spec name)."""
    import torch

    from ...architectures import LINEAR, get_layer_map
    from ...hooks import capture_module_inputs, eval_mode

    dtype = torch.float64 if dtype is None else dtype
    layer_map = get_layer_map(expert, "experts").for_batches({"task": list(batches)})
    tower = layer_map.tower(expert)
    grams: dict[tuple[int, int, str], Tensor] = {}
    with torch.no_grad(), eval_mode(expert):
        previous: list[Any] = [None] * len(batches)
        for si, stack in enumerate(layer_map.stacks(tower)):
            states = [layer_map.enter_stack(tower, b, si, previous[k]) for k, b in enumerate(batches)]
            for bi, block in enumerate(stack.blocks):
                specs = [s for s in layer_map.block_modules(block) if s.kind == LINEAR]
                captures = sorted({s.capture for s in specs})
                for k, state in enumerate(states):
                    with layer_map.capture_context(block), capture_module_inputs(block, captures) as store:
                        after = layer_map.run_block(block, bi, state)
                    for spec in specs:
                        x = store[spec.capture].to(dtype)
                        w = layer_map.input_weights(spec.name, state).to(device=x.device, dtype=dtype)
                        x = x.reshape(-1, x.shape[-1])
                        gram = (x * w.reshape(-1, 1)).T @ x
                        key = (si, bi, spec.name)
                        grams[key] = gram if key not in grams else grams[key] + gram
                    states[k] = after
            previous = states
    return grams


def regmean_merging(
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    calibration_data: Mapping[str, Any],
    *,
    reduction: float = 0.9,
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
        num_samples_per_task, batch_size, processing_class, seed: how calibration data is batched
            (as in `FeatCalConfig` / `FeatCalCalibrator`; texts truncated to the model's maximum).

    Raises:
        ValueError: before any Gram is computed, with the calibrator's checks and messages: a task
            without data or expert, an empty task, out-of-range `num_samples_per_task` / `batch_size`,
            batches the model cannot take, an expert of another configuration (fewer layers, other
            head count, ...); after the task's Grams, before any solve: non-finite features
            (`FeatCalError`, naming the task, block and module).
    """
    import torch

    from ...architectures import LINEAR, get_layer_map, model_config
    from ...config import FeatCalConfig
    from ...data import prepare_batches, text_length_limit
    from ...experts import module_device
    from ...parameters import ModelParameters
    from ...pipeline.checks import check_batches_enter_model, check_not_empty
    from ...pipeline.context import RunContext, check_finite
    from ...solver import symmetric_solve
    from ..engine import record_merge

    _check_arguments(base_model, experts, calibration_data)
    (reduction,) = get_method("regmean").check(reduction=reduction)
    try:  # the same ranges as FeatCal's batching
        config = FeatCalConfig(num_samples_per_task=num_samples_per_task, batch_size=batch_size, seed=seed)
    except ValueError as err:
        raise ValueError(f"regmean_merging: {err}") from None
    layer_map = get_layer_map(base_model, "base_model")
    max_length = text_length_limit(None, layer_map.tower_config(model_config(base_model)), processing_class)
    # the calibrator's checks, before any work: batches that enter the model; then the merge of the other
    # parameters, which refuses experts of another configuration (the calibrator's `check_compatible`)
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
    stack_names = [stack.name for stack in layer_map.stacks(layer_map.tower(base_model))]
    merged = simple_average(base_model, experts)
    grams = {}
    for task, expert in experts.items():
        grams[task] = expert_grams(expert, batches[task])
        for (si, bi, name), gram in grams[task].items():  # NaN features: named here, not by the solver
            where = f"features of calibration_data[{task!r}] entering block {bi} of {stack_names[si]}, module {name}"
            check_finite(gram, where)
    towers = {task: layer_map.tower(expert) for task, expert in experts.items()}
    merged_tower = layer_map.tower(merged)
    with torch.no_grad():
        for si, stack in enumerate(layer_map.stacks(merged_tower)):
            expert_stacks = {t: layer_map.stacks(towers[t])[si] for t in experts}
            for bi, block in enumerate(stack.blocks):
                for spec in (s for s in layer_map.block_modules(block) if s.kind == LINEAR):
                    lhs, rhs = None, None
                    for task in experts:
                        g = grams[task][(si, bi, spec.name)]
                        g = reduction * g + (1.0 - reduction) * torch.diag(g.diagonal())
                        weight = spec.value(expert_stacks[task].blocks[bi]).to(g.dtype)
                        lhs = g if lhs is None else lhs + g
                        rhs = g @ weight.T if rhs is None else rhs + g @ weight.T
                    assert lhs is not None and rhs is not None  # there is at least one expert
                    solution, _ = symmetric_solve(lhs, rhs)
                    if not bool(torch.isfinite(solution).all()):
                        raise FloatingPointError(
                            f"RegMean: non-finite solution for block {bi} of {stack.name}, {spec.name}."
                        )
                    module = block.get_submodule(spec.owner)
                    target = getattr(module, spec.weight_attr)
                    rows = slice(None) if spec.rows is None else slice(*spec.rows)
                    target.data[rows] = solution.T.to(dtype=target.dtype, device=target.device)
    record_merge(merged, {"method": "regmean", "reduction": reduction, "experts": list(experts)})
    return merged


METHOD = register(MergeMethod(
    "regmean", regmean_merging, summary="closed-form least squares per Linear from each expert's input Grams",
    reference="Jin et al., ICLR 2023, \"Dataless Knowledge Fusion by Merging Weights of Language Models\"",
    parameters=(MergeParameter("reduction", float, 0.9, "scale r of the Grams' off-diagonal entries",
                               interval=(0.0, 1.0, False, False)),),
    paper_defaults={"reduction": 0.9}, needs_calibration_data=True,
))
