"""A small but real multi-task merging scenario, fully offline: ``build_digits_scenario`` (the
scenario of ``hf-featcal demo``).

It mimics the usual CLIP ViT model-merging benchmark (one pre-trained vision encoder, one
fully fine-tuned expert per task, frozen task-specific classification heads, experts merged in
weight space) at a size that trains in seconds on a laptop CPU.

Data
    scikit-learn's bundled ``load_digits`` (1797 grey 8x8 images, 10 classes; no download).
    Every image gets its own random light foreground / dark background colour (fixed per image,
    shared by all tasks), is upsampled (bicubic) to ``16x16`` RGB and normalised with mean 0.5 /
    std 0.5.  (Colour and smooth upsampling give 4x4 patches of full rank; grey nearest-neighbour
    patches would span only 4 of the 48 patch dimensions.)  The images are split once (fixed seed)
    into a *pre-training pool* (``pretrain_size`` images, default 500) and a *task pool* (the
    rest, 1297 images) that every task splits into the same train (75 %, 973) / test (25 %, 324)
    indices.

Tasks (``DIGITS_TASKS``) -- different input "domains" and labellings of the task pool:
    ``digits``    plain images, 10-way digit identity;
    ``rotated``   images rotated by 90 degrees, 10-way digit identity;
    ``inverted``  negative images (``1 - intensity``: dark digit on a light background), 10-way;
    ``parity``    mirrored (left-right flipped) images, 2-way odd / even.

Models
    * base: a tiny random-init ``CLIPVisionModel`` (hidden 48, 3 layers, 4 heads, MLP 96,
      image 16, patch 4 -> 16 patches + class token) "pre-trained" with supervised 10-way digit
      classification of the *plain* images of the pre-training pool (Adam, ``pretrain_epochs``
      epochs, throw-away linear head).  Like an ImageNet/CLIP backbone it is good on its
      pre-training domain and mediocre on shifted domains (rotated/inverted/mirrored).
    * heads: per task, a ``torch.nn.Linear`` on ``pooler_output`` (post-LayerNorm class token),
      fitted as a *few-shot* linear probe on the base's frozen features (``head_shots`` labelled
      examples per class) -- the analogue of CLIP's zero-shot text heads: task-specific, computed
      from the base model, frozen during fine-tuning and never merged.
    * experts: per task, full fine-tuning of a copy of the base vision model (Adam,
      ``finetune_epochs`` epochs, ``finetune_lr``) with that task's head frozen.

With the defaults (seed 0) the base reaches ~69 % average test accuracy (with the task heads), the
experts ~96 % on their own tasks and the Task-Arithmetic merge (scaling 0.3) ~74 %: the usual
"base < merge << experts" picture of model merging.  Building takes ~15-20 s on 2 CPU cores
(one intra-op thread is used while training); pass ``cache_dir`` to save the models once and
reload them afterwards.

Everything is deterministic for a fixed ``seed`` (the global torch RNG is forked, not consumed).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..progress import progress_bar
from .base import (
    MergingScenario,
    ScenarioSettings,
    build_or_load,
    load_heads,
    load_models,
    reproducible_training,
    save_build,
    save_heads,
    task_generator,
)

__all__ = [
    "DIGITS_TASKS",
    "DigitsScenario",
    "DigitsScenarioSettings",
    "TaskData",
    "accuracy",
    "build_digits_scenario",
    "calibration_batches",
    "calibration_dataset",
    "evaluate_tasks",
    "finetune_expert",
    "fit_probe_head",
    "load_digits_tasks",
    "pretrain_base",
    "tiny_vision_config",
]

#: The four tasks of the scenario, in order.
DIGITS_TASKS: tuple[str, ...] = ("digits", "rotated", "inverted", "parity")

_CACHE_FORMAT = 2  # bump when the build recipe changes, to invalidate old caches


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def _rot90(x: Tensor) -> Tensor:
    return torch.rot90(x, 1, dims=(-2, -1))


def _invert(x: Tensor) -> Tensor:
    return 1.0 - x


def _mirror(x: Tensor) -> Tensor:
    return x.flip(-1)


def _identity(x: Tensor) -> Tensor:
    return x


def _digit(y: Tensor) -> Tensor:
    return y


def _parity(y: Tensor) -> Tensor:
    return y % 2


# task -> (transform of the (N, 3, 8, 8) RGB images in [0, 1], label transform, number of classes)
_TASK_DEFINITIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor], int]] = {
    "digits": (_identity, _digit, 10),
    "rotated": (_rot90, _digit, 10),
    "inverted": (_invert, _digit, 10),
    "parity": (_mirror, _parity, 2),
}


@dataclass
class TaskData:
    """Train/test tensors of one task: images ``(N, 3, S, S)`` float32, labels ``(N,)`` int64."""

    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    num_classes: int


def _colourise(images: Tensor, generator: torch.Generator | None) -> Tensor:
    """``(N, 8, 8)`` grey images in [0, 1] -> ``(N, 3, 8, 8)`` RGB images.

    With a generator every image gets its own light foreground colour (each channel uniform in
    [0.6, 1]) on a dark background colour (each channel uniform in [0, 0.3]); without one the
    image is repeated over the three channels (grey).
    """
    x = images.unsqueeze(1)
    if generator is None:
        return x.repeat(1, 3, 1, 1)
    n = images.shape[0]
    foreground = 0.6 + 0.4 * torch.rand(n, 3, 1, 1, generator=generator)
    background = 0.3 * torch.rand(n, 3, 1, 1, generator=generator)
    return background + (foreground - background) * x


def _to_pixel_values(images: Tensor, image_size: int, upsample: str = "bicubic") -> Tensor:
    """``(N, 3, 8, 8)`` images in [0, 1] -> normalised ``(N, 3, image_size, image_size)`` pixel values."""
    if image_size % 8 != 0 or image_size <= 0:
        raise ValueError(f"`image_size` must be a positive multiple of 8, got {image_size!r}")
    if upsample not in ("nearest", "bilinear", "bicubic"):
        raise ValueError(f"`upsample` must be 'nearest', 'bilinear' or 'bicubic', got {upsample!r}")
    x = images
    if image_size != 8:
        kwargs = {} if upsample == "nearest" else {"align_corners": False}
        x = F.interpolate(x, size=(image_size, image_size), mode=upsample, **kwargs).clamp(0.0, 1.0)
    x = (x - 0.5) / 0.5
    return x.contiguous()


def load_digits_tasks(
    seed: int = 0,
    tasks: Sequence[str] = DIGITS_TASKS,
    *,
    image_size: int = 16,
    upsample: str = "bicubic",
    colour: bool = True,
    pretrain_size: int = 500,
    test_fraction: float = 0.25,
) -> tuple[tuple[Tensor, Tensor], dict[str, TaskData]]:
    """Build the pre-training pool and the per-task train/test splits from ``load_digits``.

    Args:
        seed: Seed of the (single) permutation that assigns images to the pre-training pool and to
            the tasks' train/test splits.
        tasks: Task names, a subset of ``DIGITS_TASKS``.
        image_size: Side of the produced images (a multiple of 8).
        upsample: Interpolation used to upsample the 8x8 digits: "bicubic" (default), "bilinear" or
            "nearest".
        colour: Give every image a random light foreground / dark background colour (fixed per image,
            shared by all tasks; drawn from ``seed``).  Otherwise the images are grey.
        pretrain_size: Number of images held out for pre-training the base (plain view, digit labels).
        test_fraction: Fraction of the task pool used as test split (the same indices for every task).

    Returns:
        ``((pretrain_images, pretrain_labels), {task: TaskData})``.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - scikit-learn is a test/demo extra
        raise ImportError("the digits scenario needs scikit-learn (`pip install scikit-learn`)") from err

    unknown = [t for t in tasks if t not in _TASK_DEFINITIONS]
    if unknown or len(tasks) == 0:
        raise ValueError(f"`tasks` must be a non-empty subset of {DIGITS_TASKS}, got {list(tasks)!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"`tasks` contains duplicates: {list(tasks)!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction!r}")

    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32) / 16.0  # (1797, 8, 8) in [0, 1]
    labels = torch.tensor(raw.target, dtype=torch.long)
    if not 0 <= pretrain_size < len(images) - 20:
        raise ValueError(f"`pretrain_size` must be in [0, {len(images) - 20}), got {pretrain_size!r}")

    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=generator)
    pool, rest = order[:pretrain_size], order[pretrain_size:]
    n_train = int(round((1.0 - test_fraction) * len(rest)))
    images = _colourise(images, generator if colour else None)  # (N, 3, 8, 8)

    pretrain = (_to_pixel_values(images[pool], image_size, upsample), labels[pool].clone())
    data: dict[str, TaskData] = {}
    for task in tasks:
        transform_x, transform_y, num_classes = _TASK_DEFINITIONS[task]
        x = _to_pixel_values(transform_x(images[rest]), image_size, upsample)
        y = transform_y(labels[rest])
        data[task] = TaskData(
            train_images=x[:n_train].contiguous(),
            train_labels=y[:n_train].contiguous(),
            test_images=x[n_train:].contiguous(),
            test_labels=y[n_train:].contiguous(),
            num_classes=num_classes,
        )
    return pretrain, data


def calibration_batches(images: Tensor, num_samples: int = 256, batch_size: int = 32) -> list[dict[str, Tensor]]:
    """The first ``num_samples`` images as a list of ``{"pixel_values": tensor}`` batches (no labels)."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"`num_samples` and `batch_size` must be positive, got {num_samples!r}, {batch_size!r}")
    images = images[:num_samples]
    return [{"pixel_values": images[i : i + batch_size].clone()} for i in range(0, len(images), batch_size)]


def calibration_dataset(images: Tensor, num_samples: int = 256) -> Any:
    """The first ``num_samples`` images as a ``datasets.Dataset`` with a ``"pixel_values"`` column
    (torch format: each row's ``pixel_values`` is a ``(3, S, S)`` float32 tensor)."""
    from datasets import Dataset

    values = images[:num_samples].numpy()
    return Dataset.from_dict({"pixel_values": list(values)}).with_format("torch")


# ---------------------------------------------------------------------------------------------
# Models and training
# ---------------------------------------------------------------------------------------------
def tiny_vision_config(
    hidden_size: int = 48,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    intermediate_size: int | None = None,
    image_size: int = 16,
    patch_size: int = 4,
) -> Any:
    """A tiny ``CLIPVisionConfig`` (``intermediate_size`` defaults to ``2 * hidden_size``)."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        projection_dim=hidden_size,
    )


def _pooled(vision_model: nn.Module, pixel_values: Tensor) -> Tensor:
    return vision_model(pixel_values=pixel_values).pooler_output


def _train(
    vision_model: nn.Module,
    head: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    train_head: bool,
    description: str,
) -> None:
    params = list(vision_model.parameters()) + (list(head.parameters()) if train_head else [])
    head.requires_grad_(train_head)
    optimizer = torch.optim.Adam(params, lr=lr)
    vision_model.train()
    starts = range(0, len(images), batch_size)
    with progress_bar(total=epochs * len(starts), desc=description, unit="step") as bar:
        for _ in range(epochs):
            order = torch.randperm(len(images), generator=generator)
            for start in starts:
                idx = order[start : start + batch_size]
                loss = F.cross_entropy(head(_pooled(vision_model, images[idx])), labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                bar.update(1)
    vision_model.eval()
    head.requires_grad_(True)
    vision_model.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)


def pretrain_base(
    vision_model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    epochs: int = 15,
    lr: float = 1e-3,
    batch_size: int = 64,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Supervised "pre-training" of ``vision_model`` in place (10-way digits, throw-away head)."""
    generator = generator or torch.Generator().manual_seed(0)
    head = nn.Linear(vision_model.config.hidden_size, int(labels.max()) + 1)
    _train(vision_model, head, images, labels, epochs=epochs, lr=lr, batch_size=batch_size,
           generator=generator, train_head=True, description="Pre-training the base")
    return vision_model


@torch.no_grad()
def _features(vision_model: nn.Module, images: Tensor, batch_size: int = 512) -> Tensor:
    vision_model.eval()
    return torch.cat([_pooled(vision_model, images[i : i + batch_size]) for i in range(0, len(images), batch_size)])


def fit_probe_head(
    vision_model: nn.Module,
    images: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    shots: int | None = 10,
    steps: int = 50,
    lr: float = 1e-2,
) -> nn.Linear:
    """A linear head on ``pooler_output`` fitted on frozen features (full-batch Adam).

    ``shots`` limits the fit to the first ``shots`` examples of each class (a few-shot probe, the
    analogue of a zero-shot head); ``None`` uses every example.  The head is initialised from the
    global torch RNG (seed it for reproducibility; ``build_digits_scenario`` does).
    """
    features = _features(vision_model, images)
    if shots is not None:
        keep = torch.cat([torch.nonzero(labels == k).flatten()[:shots] for k in range(num_classes)])
        features, labels = features[keep], labels[keep]
    head = nn.Linear(features.shape[1], num_classes)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(head(features), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    head.zero_grad(set_to_none=True)
    return head.eval()


def finetune_expert(
    base_model: nn.Module,
    head: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    epochs: int = 15,
    lr: float = 5e-4,
    batch_size: int = 64,
    train_head: bool = False,
    generator: torch.Generator | None = None,
    description: str = "Fine-tuning an expert",
) -> nn.Module:
    """Fully fine-tune a deep copy of ``base_model`` on one task (Adam); returns the expert.

    The head is frozen unless ``train_head`` (then it is updated in place). ``description`` labels the
    progress bar (`hf_featcal.progress`).
    """
    generator = generator or torch.Generator().manual_seed(0)
    expert = copy.deepcopy(base_model)
    _train(expert, head, images, labels, epochs=epochs, lr=lr, batch_size=batch_size,
           generator=generator, train_head=train_head, description=description)
    return expert.eval()


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(vision_model: nn.Module, head: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``head(vision_model(pixel_values=images).pooler_output)`` on ``labels``.

    The model is put in eval mode; images go to the model's device and features to the head's
    (neither module is moved).
    """
    vision_model.eval()
    model_device = next(vision_model.parameters()).device
    head_param = next(head.parameters(), None)
    head_device = head_param.device if head_param is not None else torch.device("cpu")
    correct = 0
    for start in range(0, len(images), batch_size):
        features = _pooled(vision_model, images[start : start + batch_size].to(model_device))
        predictions = head(features.to(head_device)).argmax(-1).cpu()
        correct += int((predictions == labels[start : start + batch_size].cpu()).sum())
    return correct / max(len(images), 1)


def evaluate_tasks(
    vision_model: nn.Module,
    heads: Mapping[str, nn.Module],
    data: Mapping[str, TaskData],
    split: str = "test",
) -> dict[str, float]:
    """Per-task accuracy of one vision model with each task's head on ``split`` ("test"/"train")."""
    if split not in ("test", "train"):
        raise ValueError(f"`split` must be 'test' or 'train', got {split!r}")
    out = {}
    for task, head in heads.items():
        d = data[task]
        images, labels = (d.test_images, d.test_labels) if split == "test" else (d.train_images, d.train_labels)
        out[task] = accuracy(vision_model, head, images, labels)
    return out


# ---------------------------------------------------------------------------------------------
# The scenario
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DigitsScenarioSettings(ScenarioSettings):
    """Every setting that determines a built scenario (used as the cache key)."""

    cache_name = "digits"
    cache_format = _CACHE_FORMAT

    seed: int = 0
    tasks: tuple[str, ...] = DIGITS_TASKS
    image_size: int = 16
    upsample: str = "bicubic"
    colour: bool = True
    patch_size: int = 4
    hidden_size: int = 48
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 96
    pretrain_size: int = 500
    pretrain_epochs: int = 15
    pretrain_lr: float = 1e-3
    head_shots: int | None = 10
    finetune_epochs: int = 15
    finetune_lr: float = 5e-4
    batch_size: int = 64
    test_fraction: float = 0.25


@dataclass
class DigitsScenario(MergingScenario):
    """A built multi-task merging scenario (see the module docstring).

    Attributes:
        base: The pre-trained ``CLIPVisionModel``.
        experts: Task name -> fully fine-tuned ``CLIPVisionModel``.
        heads: Task name -> frozen ``nn.Linear`` head on ``pooler_output`` (shared by base, experts
            and any merged model; never merged).
        data: Task name -> ``TaskData`` (train/test images and labels).
        calibration: Task name -> list of ``{"pixel_values": tensor}`` batches (unlabelled images
            from the task's *train* split) -- the ``calibration_data`` of ``FeatCalCalibrator``.
        calibration_datasets: The same images per task as ``datasets.Dataset`` (``"pixel_values"``
            column, torch format).
        settings: The ``DigitsScenarioSettings`` it was built with.
        pretrain_images, pretrain_labels: The base's pre-training pool (plain images).
        loaded_from_cache: Whether the models were loaded from ``cache_dir``.
        cache_path: The folder the models were saved to / loaded from (None without ``cache_dir``).
    """

    base: nn.Module
    experts: dict[str, nn.Module]
    heads: dict[str, nn.Linear]
    data: dict[str, TaskData]
    calibration: dict[str, list[dict[str, Tensor]]]
    calibration_datasets: dict[str, Any]
    settings: DigitsScenarioSettings
    pretrain_images: Tensor
    pretrain_labels: Tensor
    loaded_from_cache: bool = False
    cache_path: str | None = None

    def evaluate(self, vision_model: nn.Module, split: str = "test") -> dict[str, float]:
        """Per-task accuracy of ``vision_model`` with every task's head."""
        return evaluate_tasks(vision_model, self.heads, self.data, split)

    def evaluate_task(self, vision_model: nn.Module, task: str, split: str = "test") -> float:
        """Accuracy of ``vision_model`` with ``task``'s head on that task's ``split`` (one task scored)."""
        return accuracy(vision_model, self.heads[task], *self._split(task, split))

    def evaluate_experts(self, split: str = "test") -> dict[str, float]:
        """Each expert's accuracy on its own task."""
        return {t: self.evaluate_task(self.experts[t], t, split) for t in self.tasks}

    def _split(self, task: str, split: str) -> tuple[Tensor, Tensor]:
        d = self.data[task]
        if split == "test":
            return d.test_images, d.test_labels
        if split == "train":
            return d.train_images, d.train_labels
        raise ValueError(f"`split` must be 'test' or 'train', got {split!r}")


def _cache_key(settings: DigitsScenarioSettings) -> dict[str, Any]:
    return {"format": _CACHE_FORMAT, "settings": asdict(settings)}


_Models = tuple[nn.Module, dict[str, nn.Module], dict[str, nn.Linear]]  # base, experts, heads


def _save_cache(path: str, settings: DigitsScenarioSettings, models: _Models) -> None:
    base, experts, heads = models
    folders = {"base": base, **{os.path.join("experts", t): e for t, e in experts.items()}}
    save_build(path, _cache_key(settings), folders, lambda folder: save_heads(folder, heads))


def _load_cache(path: str, settings: DigitsScenarioSettings) -> _Models:
    from transformers import CLIPVisionModel

    experts = load_models(CLIPVisionModel.from_pretrained, path,
                          {"base": "base", **{t: os.path.join("experts", t) for t in settings.tasks}})
    base = experts.pop("base")  # not a task name (tasks are checked against DIGITS_TASKS)
    return base, experts, load_heads(path, settings.tasks)


def build_digits_scenario(
    seed: int = 0,
    *,
    tasks: Sequence[str] = DIGITS_TASKS,
    cache_dir: str | os.PathLike | None = None,
    calibration_samples: int = 256,
    calibration_batch_size: int = 32,
    **overrides: Any,
) -> DigitsScenario:
    """Build (or load from ``cache_dir``) the offline multi-task digits merging scenario.

    Steps: split ``load_digits`` into a pre-training pool and per-task train/test splits; pre-train a
    tiny ``CLIPVisionModel`` on the plain pool; fit a frozen few-shot linear head per task on the
    base's features; fully fine-tune one expert per task.  See the module docstring for the design.

    Args:
        seed: Seed for the data split, model init, heads and training order (fully deterministic).
        tasks: Task names, a subset of ``DIGITS_TASKS`` (default: all four).
        cache_dir: If given, models are saved under ``cache_dir/digits-<hash of the settings>/``
            (``save_pretrained`` for the base and experts, ``heads.safetensors`` for the heads) and
            reloaded from there when present.
        calibration_samples: Unlabelled train images per task in ``calibration`` /
            ``calibration_datasets``.
        calibration_batch_size: Batch size of ``calibration``.
        **overrides: Any other field of ``DigitsScenarioSettings`` (e.g. ``finetune_epochs=5``,
            ``hidden_size=32``) for smaller/faster variants.

    Training the base and each expert shows a progress bar of its steps (`hf_featcal.progress`).

    Returns:
        A ``DigitsScenario``; every model is in eval mode on CPU.
    """
    settings = DigitsScenarioSettings.from_arguments(seed, tasks, overrides)
    pretrain, data = load_digits_tasks(
        settings.seed,
        settings.tasks,
        image_size=settings.image_size,
        upsample=settings.upsample,
        colour=settings.colour,
        pretrain_size=settings.pretrain_size,
        test_fraction=settings.test_fraction,
    )

    cache_path = settings.cache_path(cache_dir)
    (base, experts, heads), loaded = build_or_load(
        cache_path,
        _cache_key(settings),
        build=lambda: _build_models(settings, pretrain, data),
        save=lambda path, models: _save_cache(path, settings, models),
        load=lambda path: _load_cache(path, settings),
    )

    calibration = {
        t: calibration_batches(data[t].train_images, calibration_samples, calibration_batch_size)
        for t in settings.tasks
    }
    calibration_sets = {t: calibration_dataset(data[t].train_images, calibration_samples) for t in settings.tasks}
    return DigitsScenario(
        base=base,
        experts=experts,
        heads=heads,
        data=data,
        calibration=calibration,
        calibration_datasets=calibration_sets,
        settings=settings,
        pretrain_images=pretrain[0],
        pretrain_labels=pretrain[1],
        loaded_from_cache=loaded,
        cache_path=cache_path,
    )


def _build_models(
    settings: DigitsScenarioSettings, pretrain: tuple[Tensor, Tensor], data: Mapping[str, TaskData]
) -> _Models:
    with reproducible_training():
        return _train_models(settings, pretrain, data)


def _train_models(
    settings: DigitsScenarioSettings, pretrain: tuple[Tensor, Tensor], data: Mapping[str, TaskData]
) -> _Models:
    from transformers import CLIPVisionModel

    config = tiny_vision_config(
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        intermediate_size=settings.intermediate_size,
        image_size=settings.image_size,
        patch_size=settings.patch_size,
    )
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    base = CLIPVisionModel(config)
    if settings.pretrain_epochs > 0 and settings.pretrain_size > 0:
        pretrain_base(base, pretrain[0], pretrain[1], epochs=settings.pretrain_epochs, lr=settings.pretrain_lr,
                      batch_size=settings.batch_size, generator=generator)
    base.eval()
    heads: dict[str, nn.Linear] = {}
    experts: dict[str, nn.Module] = {}
    for task in settings.tasks:
        # its own seeded stream: ``tasks=("digits",)`` gives the same "digits" head and expert
        task_stream = task_generator(settings.seed, DIGITS_TASKS.index(task))
        d = data[task]
        heads[task] = fit_probe_head(base, d.train_images, d.train_labels, d.num_classes, shots=settings.head_shots)
        experts[task] = finetune_expert(base, heads[task], d.train_images, d.train_labels,
                                        epochs=settings.finetune_epochs, lr=settings.finetune_lr,
                                        batch_size=settings.batch_size, generator=task_stream,
                                        description=f"Fine-tuning the {task!r} expert")
    return base, experts, heads

