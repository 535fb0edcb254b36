"""Representation Surgery and ProbSurgery as post-merging steps: `fit_surgery` trains, per task, a small
module that moves the merged model's representation towards the task's expert's.

How it trains (docs/surgery.md says why):

- Calibration data is taken the way FeatCal takes it: `hf_featcal.data.prepare_batches` with
  `num_samples_per_task` drawn by `data.sample_examples` with `data_seed` (FeatCal's default seed), so
  every post-merging step of a grid given the same data and numbers sees the same examples. Never the
  test split: the original Surgery papers trained on the test images; give a held-out or training split.
- The merged model and every expert are frozen and the inputs are not augmented, so each one's
  representation of an input is a constant: it is computed once per calibration input (merged: one
  forward per batch; each expert: one forward per batch, one expert in memory at a time) and the
  modules train on those tensors. This equals the original code's back-propagation through the frozen
  network, which recomputed the same constants at every step.
- Each task's module trains on its own (its own Adam optimizer, its own seeded batch order and noise,
  `task_modules.task_seed`): no other task's module moves. The original Surgery code put every task's
  module in one optimizer; on torch < 2.0, Adam stepped parameters whose gradient was zero with their
  stale momentum, so training one task moved the others.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..architectures import get_layer_map, model_config
from ..config import FeatCalConfig
from ..data import Batch, prepare_batches, text_length_limit
from ..experts import InMemorySource, ModelSource, load_model, make_source, module_device
from ..pipeline.checks import check_compatible, check_not_empty, check_tasks
from .corrections import CORRECTIONS, ProbSurgeryModule, SurgeryModule
from .representation import RepresentationPoint, representation_point, representations, required_batch_keys
from .task_modules import TaskModules, task_seed

__all__ = ["DEFAULT_STEPS", "ProbSurgeryModule", "SurgeryModule", "calibration_batches", "fit_surgery", "train_module"]

#: Training steps per task (per module) when `steps` is None: the papers' settings.
DEFAULT_STEPS = {"surgery": 1000, "prob_surgery": 5000}


def train_module(
    module: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 16,
    seed: int = 0,
    show_progress: bool = False,
    description: str = "",
) -> list[float]:
    """Train one correction `module` (its `training_loss`) to map `inputs` (the merged model's
    representations, rows) to `targets` (the expert's), with Adam, `steps` steps of `batch_size` rows
    drawn without replacement in a fresh seeded order each pass (a shorter last batch ends a pass).
    Only `module`'s parameters move. Returns the loss of every step; a non-finite loss or gradient stops
    training with a ValueError before that step (the module keeps the last finite parameters)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    rows, position = len(inputs), len(inputs)
    order = torch.empty(0, dtype=torch.long)
    losses: list[Tensor] = []
    progress = _progress(steps, description) if show_progress else None
    module.train()
    try:
        for step in range(steps):
            if position >= rows:
                order, position = torch.randperm(rows, generator=generator), 0
            index = order[position:position + batch_size].to(inputs.device)
            position += batch_size
            loss = module.training_loss(inputs[index], targets[index], generator)  # type: ignore[operator]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # checked before the step, so the module keeps the last finite parameters; one sum carries
            # any NaN/Inf of the loss and the gradients, so the check costs one device sync per step
            grads = [p.grad.abs().sum() for p in module.parameters() if p.grad is not None]
            if not math.isfinite(float(loss.detach() + torch.stack(grads).sum())):
                raise ValueError(
                    f"{description or 'the module'}: the loss or its gradient became non-finite at step {step} "
                    f"(loss {float(loss.detach())}); lower `lr`."
                )
            optimizer.step()
            losses.append(loss.detach())
            if progress is not None:
                progress.update(1)
    finally:
        module.eval()
        if progress is not None:
            progress.close()
    return torch.stack(losses).tolist() if losses else []


def _progress(total: int, description: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, leave=False)


# ---------------------------------------------------------------------------- argument checks
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer ≥ {minimum}, got {value!r}.")
    return value


def _check_real(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ValueError(f"`{name}` must be a finite number {'> 0' if positive else '≥ 0'}, got {value!r}.")
    return float(value)


def _check_arguments(method: Any, rank: Any, hidden: Any, steps: Any, lr: Any, batch_size: Any, kl_weight: Any,
                     shared: Any, seed: Any, num_samples_per_task: Any, data_seed: Any) -> None:
    if method not in CORRECTIONS:
        raise ValueError(f"`method` must be one of {sorted(CORRECTIONS)}, got {method!r}.")
    _check_int("rank", rank, 1)
    _check_int("hidden", hidden, 1)
    if steps is not None:
        _check_int("steps", steps, 1)
    _check_real("lr", lr, positive=True)
    _check_int("batch_size", batch_size, 1)
    _check_real("kl_weight", kl_weight, positive=False)
    if not isinstance(shared, bool):
        raise ValueError(f"`shared` must be True or False, got {shared!r}.")
    _check_int("seed", seed, 0)
    if num_samples_per_task is not None:
        _check_int("num_samples_per_task", num_samples_per_task, 1)
    if data_seed is not None:
        _check_int("data_seed", data_seed, 0)


def _check_device(device: Any) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"`device` must be a torch device or its name (e.g. 'cpu', 'cuda:0'), got {device!r}."
        ) from None


def _check_batches(task: str, batches: list[Batch], keys: tuple[str, ...]) -> None:
    for index, batch in enumerate(batches):
        missing = [key for key in keys if key not in batch]
        if missing:
            raise ValueError(
                f"calibration_data[{task!r}] batch {index} lacks {missing} (keys: {sorted(batch)}), which the "
                "representation's forward needs."
            )


# ---------------------------------------------------------------------------- experts
def _expert_model(source: ModelSource, base_model: Any) -> nn.Module:
    """The expert as a whole model: the caller's, or loaded from its folder / hub id (a LoRA adapter:
    a copy of `base_model` with the adapter merged in)."""
    if isinstance(source, InMemorySource):
        return source.model
    assert source.name is not None  # a source opened from a folder or hub id keeps its name
    return load_model(source.name, source.argument, base=base_model)


def _expert_representations(
    merged: nn.Module, source: ModelSource, point: RepresentationPoint, batches: list[Batch], base_model: Any = None
) -> Tensor:
    """The expert's representations: its own model's, where it has the merged model's representation
    point (a full CLIPModel expert uses its own projection); else (a bare tower, e.g. a CLIPVisionModel
    expert of a merged CLIPModel) the merged architecture with the expert's tower weights loaded into a
    copy, so the parts outside the tower (CLIP's projection) are the merged model's."""
    expert = _expert_model(source, base_model)
    try:
        own = representation_point(expert)
    except (ValueError, TypeError):
        own = None
    if own is not None and own.module == point.module and own.dim == point.dim:
        return representations(expert, batches, point, argument=source.argument)
    layer_map = get_layer_map(merged)
    scratch = copy.deepcopy(merged)
    try:
        layer_map.tower(scratch).load_state_dict(layer_map.tower(expert).state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(f"`{source.argument}`: its tower does not fit the merged model's: {err}") from None
    return representations(scratch, batches, point, argument=source.argument)


# ---------------------------------------------------------------------------- the step
def calibration_batches(
    merged: nn.Module,
    calibration_data: Mapping[str, Any],
    *,
    num_samples_per_task: int | None = None,
    data_seed: int | None = None,
    processing_class: Any = None,
    data_collator: Callable[[list[dict]], Batch] | None = None,
    max_length: int | None = None,
) -> dict[str, list[Batch]]:
    """Task → the calibration batches `fit_surgery` computes representations on: taken as
    `FeatCalCalibrator` takes them (`data.prepare_batches`, `FeatCalConfig`'s default batch size, the
    draw seeded with `data_seed`, default `FeatCalConfig`'s seed), so FeatCal and these steps given the
    same data and numbers see the same examples. Every task gives a batch, and every batch has what the
    representation's forward needs (ValueErrors naming the task and batch otherwise)."""
    point = representation_point(merged)
    layer_map = get_layer_map(merged, "merged")
    defaults = FeatCalConfig()
    text_limit = text_length_limit(max_length, layer_map.tower_config(model_config(merged)), processing_class)
    keys = required_batch_keys(merged, point)
    batches: dict[str, list[Batch]] = {}
    for task, data in calibration_data.items():
        batches[task] = prepare_batches(
            task, data, main_input_name=layer_map.main_input_name, num_samples=num_samples_per_task,
            batch_size=defaults.batch_size, seed=defaults.seed if data_seed is None else data_seed,
            data_collator=data_collator, processing_class=processing_class, max_length=text_limit,
        )
        check_not_empty(task, batches[task])
        _check_batches(task, batches[task], keys)
    return batches


def fit_surgery(
    merged: nn.Module,
    experts: Mapping[str, nn.Module | str | os.PathLike],
    calibration_data: Mapping[str, Any],
    *,
    method: str = "surgery",
    rank: int = 16,
    hidden: int = 128,
    steps: int | None = None,
    lr: float = 1e-3,
    batch_size: int = 16,
    kl_weight: float = 1e-4,
    shared: bool = False,
    seed: int = 0,
    num_samples_per_task: int | None = None,
    processing_class: Any = None,
    device: str | torch.device | None = None,
    show_progress: bool = False,
    data_seed: int | None = None,
    data_collator: Callable[[list[dict]], Batch] | None = None,
    max_length: int | None = None,
    base_model: nn.Module | str | os.PathLike | None = None,
) -> TaskModules:
    """Train Representation Surgery (`method="surgery"`) or ProbSurgery (`"prob_surgery"`) modules that
    correct `merged`'s representation (`representation.representation_point`) towards each task's expert.

    Args:
        merged: the merged model (frozen: never changed; run in eval mode).
        experts: task → expert (a model, a local folder or a hub id; a LoRA adapter folder is merged
            into `base_model`). A bare tower (a `CLIPVisionModel` expert of a merged `CLIPModel`)
            is read through the merged model's parts outside the tower (its projection).
        calibration_data: task → `datasets.Dataset` or iterable of batches, as `FeatCalCalibrator`
            takes it (never the test split).
        method: "surgery" (ẑ = z − U·ReLU(D·z)) or "prob_surgery" (ẑ = z − μ(z) at inference).
        rank: Surgery's rank (D: dim → rank, U: rank → dim).
        hidden: ProbSurgery's hidden width (A: dim → hidden).
        steps: Adam steps per module; None: 1000 for surgery, 5000 for prob_surgery.
        lr: Adam's learning rate.
        batch_size: rows per step (one row per example; per weighted position for T5 / Llama).
        kl_weight: ProbSurgery's weight of KL(N(μ, σ²) ‖ N(0, I)).
        shared: one module for every task, trained on every task's rows (no task needed at inference).
        seed: seeds each module's init, batch order and noise (`task_modules.task_seed`).
        num_samples_per_task: examples per task (None: all that are given), drawn with `data_seed`.
        processing_class: image processor / transform / tokenizer for dataset rows (as FeatCal's).
        device: where the modules train (default: the merged model's device).
        show_progress: a progress bar per module.
        data_seed: the draw's seed; None: `FeatCalConfig`'s default seed, so FeatCal and these steps
            draw the same examples.
        data_collator, max_length: as `FeatCalCalibrator` / `FeatCalConfig.max_length`.
        base_model: the model LoRA adapter experts were trained on (a model, folder or hub id); needed
            only for adapter experts.

    Every argument is checked before any forward. Returns the trained `TaskModules` (apply them with
    `modules.for_task(merged, task)`).
    """
    _check_arguments(method, rank, hidden, steps, lr, batch_size, kl_weight, shared, seed, num_samples_per_task,
                     data_seed)
    if not isinstance(merged, nn.Module):
        raise TypeError(f"`merged` must be the merged model (a torch.nn.Module), got {type(merged).__name__}.")
    point = representation_point(merged)
    tasks = check_tasks(experts, calibration_data)
    layer_map = get_layer_map(merged, "merged")
    config = model_config(merged)
    base = None if base_model is None else make_source(base_model, "base_model", layer_map)
    sources = {task: make_source(experts[task], f"experts[{task!r}]", layer_map, base) for task in tasks}
    for source in sources.values():
        check_compatible(source, layer_map, merged, config)
        source.check_finite(merged)
    train_device = _check_device(device) if device is not None else module_device(merged)
    batches = calibration_batches(
        merged, {task: calibration_data[task] for task in tasks}, num_samples_per_task=num_samples_per_task,
        data_seed=data_seed, processing_class=processing_class, data_collator=data_collator, max_length=max_length,
    )
    data_seed = FeatCalConfig().seed if data_seed is None else data_seed

    # the frozen models' representations, once per calibration input
    inputs = {task: representations(merged, batches[task], point, argument="merged").to(train_device)
              for task in tasks}
    targets = {}
    for task in tasks:
        targets[task] = _expert_representations(merged, sources[task], point, batches[task],
                                                base_model).to(train_device)
        if targets[task].shape != inputs[task].shape:
            raise ValueError(f"`experts[{task!r}]` gives representations of shape {tuple(targets[task].shape)}, "
                             f"the merged model {tuple(inputs[task].shape)}.")

    hyper = {"rank": rank} if method == "surgery" else {"hidden": hidden, "kl_weight": kl_weight}
    steps = DEFAULT_STEPS[method] if steps is None else steps
    modules = TaskModules(
        method, tasks, point, shared=shared, seed=seed, hyper_parameters=hyper,
        training={"steps": steps, "lr": lr, "batch_size": batch_size, "optimizer": "Adam",
                  "rows_per_task": {task: len(inputs[task]) for task in tasks},
                  "num_samples_per_task": num_samples_per_task,
                  "data_seed": data_seed},
    ).to(train_device)
    if shared:
        train_module(modules.module_for(None), torch.cat([inputs[t] for t in tasks]),
                     torch.cat([targets[t] for t in tasks]), steps=steps, lr=lr, batch_size=batch_size,
                     seed=task_seed(seed, ""), show_progress=show_progress, description=f"{method} (shared)")
    else:
        for task in tasks:
            train_module(modules.module_for(task), inputs[task], targets[task], steps=steps, lr=lr,
                         batch_size=batch_size, seed=task_seed(seed, task), show_progress=show_progress,
                         description=f"{method} {task}")
    return modules
