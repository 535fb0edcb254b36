"""Zero-shot classification evaluation of CLIP vision towers (the 8 CLIP tasks of the FeatCal paper).

The classifier of a task is the standard open_clip / task-vectors zero-shot head, as FusionBench
builds it (``HFCLIPClassifier.set_classification_task``):

1. every class name is put into every template of the task (:data:`CLIP_TEMPLATES`);
2. the prompts are embedded by the text tower of a *base* ``CLIPModel``
   (``get_text_features``: EOS-pooled, then ``text_projection``) and L2-normalised;
3. per class, the normalised embeddings are averaged over the templates and renormalised;
4. logits are ``logit_scale.exp() * normalize(image_embeds) @ class_embeddings.T``.

Image embeddings come from the model under evaluation, which may be

- a ``CLIPModel`` (its ``get_image_features``: tower + its own ``visual_projection``),
- a ``CLIPVisionModelWithProjection`` (its ``image_embeds``), or
- a bare ``CLIPVisionModel`` (e.g. the ``tanganke/clip-vit-base-patch32_<task>`` experts, or a
  calibrated/merged tower): the base ``CLIPModel``'s ``visual_projection`` is applied to its
  ``pooler_output``.

:func:`vision_tower_into_clip` puts such a tower back into a copy of the base ``CLIPModel``.

open_clip models work the same way: an open_clip ``CLIP`` embeds prompts with ``encode_text`` and
images with ``encode_image`` (a bare open_clip ``VisionTransformer`` with its own ``proj``); the
processor is then the pair ``(open_clip tokenizer, preprocess transform)``.
The reported score is top-1 accuracy per task and their plain mean.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..architectures import layer_map_or_none
from ..architectures.clip import CLIPVisionLayerMap, vision_parts
from ..experts import module_device, module_dtype
from ._datasets import local_split
from .clip_templates import (
    CLIP_CLASS_NAMES,
    CLIP_DATASETS,
    CLIP_DEFAULT_SPLIT,
    CLIP_DEFAULT_TEMPLATES,
    CLIP_IMAGE_COLUMNS,
    CLIP_LABEL_COLUMNS,
    CLIP_TASK_ALIASES,
    CLIP_TASKS,
    CLIP_TEMPLATES,
)
from .results import EvaluationResults

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset
    from transformers import CLIPModel, PreTrainedTokenizerBase

__all__ = [
    "ClipTask",
    "ClipZeroShotHead",
    "ClipZeroShotResults",
    "resolve_clip_task",
    "render_prompt",
    "render_prompts",
    "build_zeroshot_head",
    "clip_image_embeddings",
    "vision_tower_into_clip",
    "load_clip_split",
    "evaluate_clip_zeroshot",
]

PathLike = str | os.PathLike
Template = str | Callable[[str], str]

_PLACEHOLDER = "{c}"


# ------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class ClipTask:
    """One zero-shot classification task.

    Attributes:
        name: task name (canonical for the 8 built-in tasks).
        class_names: class name of each label, in label order.
        templates: prompt templates (``str`` with ``{c}``, or ``callable(class_name) -> str``).
        dataset_path: Hub dataset id (None for a custom task: a local dataset is then needed).
        dataset_config: Hub dataset config name, if any.
        image_column: name of the image column.
        label_column: name of the integer label column.
    """

    name: str
    class_names: tuple[str, ...]
    templates: tuple[Template, ...]
    dataset_path: str | None = None
    dataset_config: str | None = None
    image_column: str = "image"
    label_column: str = "label"

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.class_names)


def _known_task_name(task: str) -> str | None:
    if task in CLIP_CLASS_NAMES:
        return task
    return CLIP_TASK_ALIASES.get(task)


def _check_templates(task: str, templates: Sequence[Template], argument: str) -> tuple[Template, ...]:
    if isinstance(templates, (str, bytes)) or not isinstance(templates, Iterable):
        raise ValueError(f"{argument} for task {task!r} must be a list of templates, got {type(templates).__name__}")
    out = tuple(templates)
    if not out:
        raise ValueError(f"{argument} for task {task!r} is empty")
    for t in out:
        if isinstance(t, str):
            if _PLACEHOLDER not in t:
                raise ValueError(
                    f"{argument} for task {task!r}: template {t!r} lacks the class-name placeholder '{{c}}'"
                )
        elif not callable(t):
            raise ValueError(
                f"{argument} for task {task!r}: a template must be a str with '{{c}}' or a callable, "
                f"got {type(t).__name__}"
            )
    return out


def _check_class_names(task: str, names: Sequence[str], argument: str) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise ValueError(f"{argument} for task {task!r} must be a list of class names, got {type(names).__name__}")
    out = tuple(names)
    if len(out) < 2:
        raise ValueError(f"{argument} for task {task!r} needs at least 2 class names, got {len(out)}")
    bad = [n for n in out if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"{argument} for task {task!r}: class names must be non-empty strings, got {bad[:3]!r}")
    return out


def resolve_clip_task(
    task: str,
    class_names: Sequence[str] | None = None,
    templates: Sequence[Template] | None = None,
    *,
    argument: str = "tasks",
) -> ClipTask:
    """Class names, templates and dataset of one task.

    Args:
        task: one of :data:`CLIP_TASKS` (or an alias such as ``"stanford_cars"``), or the name
            of a custom task, for which ``class_names`` is required.
        class_names: override of the class names (label order).
        templates: override of the templates (default for a custom task:
            :data:`CLIP_DEFAULT_TEMPLATES`).
        argument: argument name used in error messages.

    Raises:
        ValueError: unknown task without ``class_names``, or malformed overrides.
    """
    if not isinstance(task, str) or not task:
        raise ValueError(f"{argument}: a task must be a non-empty string, got {task!r}")
    known = _known_task_name(task)
    if known is None and class_names is None:
        raise ValueError(
            f"{argument}: unknown CLIP task {task!r}; known tasks are {list(CLIP_TASKS)} "
            f"(to evaluate a custom task pass class_names={{{task!r}: [...]}}, optionally templates, "
            "and its dataset in datasets)"
        )
    name = known or task
    names = _check_class_names(name, class_names if class_names is not None else CLIP_CLASS_NAMES[name], "class_names")
    if templates is None:
        templates = CLIP_TEMPLATES[name] if known else CLIP_DEFAULT_TEMPLATES
    temps = _check_templates(name, templates, "templates")
    if known:
        path, config = CLIP_DATASETS[name]
        return ClipTask(name, names, temps, path, config, CLIP_IMAGE_COLUMNS[name], CLIP_LABEL_COLUMNS[name])
    return ClipTask(name, names, temps)


def render_prompt(template: Template, class_name: str) -> str:
    """The prompt of one class under one template (``{c}`` replaced, or the callable applied)."""
    if isinstance(template, str):
        return template.replace(_PLACEHOLDER, class_name)
    return template(class_name)


def render_prompts(class_names: Sequence[str], templates: Sequence[Template]) -> list[list[str]]:
    """Prompts of every class under every template: ``out[class][template]``."""
    return [[render_prompt(t, name) for t in templates] for name in class_names]


# ------------------------------------------------------------------- processors


def _split_processor(processor: Any) -> tuple[Any, Any]:
    """(tokenizer, image_processor) from a ``CLIPProcessor`` or a ``(tokenizer, image_processor)`` pair."""
    if isinstance(processor, (tuple, list)):
        if len(processor) != 2:
            raise ValueError(
                f"processor as a sequence must be (tokenizer, image_processor), got {len(processor)} items"
            )
        tokenizer, image_processor = processor
    else:
        tokenizer = getattr(processor, "tokenizer", None)
        image_processor = getattr(processor, "image_processor", None)
    if tokenizer is None or not callable(tokenizer):
        raise ValueError(
            "processor must be a CLIPProcessor (with .tokenizer and .image_processor) or a "
            f"(tokenizer, image_processor) pair; no tokenizer found in {type(processor).__name__}"
        )
    if image_processor is None or not callable(image_processor):
        raise ValueError(
            "processor must be a CLIPProcessor (with .tokenizer and .image_processor) or a "
            f"(tokenizer, image_processor) pair; no image processor found in {type(processor).__name__}"
        )
    return tokenizer, image_processor


# ------------------------------------------------------------------------- head


@dataclass
class ClipZeroShotHead:
    """A zero-shot classifier: unit class embeddings and the CLIP logit scale.

    Attributes:
        class_embeddings: ``[num_classes, dim]``, each row the renormalised mean of the
            normalised prompt embeddings of one class.
        logit_scale: ``clip_model.logit_scale.exp()`` (a float).
        class_names: class names, in label order.
        task: task name, if any.
    """

    class_embeddings: torch.Tensor
    logit_scale: float
    class_names: tuple[str, ...] = ()
    task: str | None = None

    @property
    def weight(self) -> torch.Tensor:
        """Classifier weight ``logit_scale * class_embeddings`` (``[num_classes, dim]``)."""
        return self.class_embeddings * self.logit_scale

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return int(self.class_embeddings.shape[0])

    def logits(self, image_embeds: torch.Tensor) -> torch.Tensor:
        """``logit_scale * normalize(image_embeds) @ class_embeddings.T`` in float32."""
        if image_embeds.shape[-1] != self.class_embeddings.shape[-1]:
            raise ValueError(
                f"image embeddings have dimension {image_embeds.shape[-1]}, the zero-shot head "
                f"{self.class_embeddings.shape[-1]} (projection dimensions of vision model and clip_model differ)"
            )
        image = image_embeds.float()
        image = image / image.norm(dim=-1, keepdim=True)
        weight = self.class_embeddings.to(device=image.device, dtype=torch.float32)
        return self.logit_scale * image @ weight.T


def build_zeroshot_head(
    clip_model: CLIPModel,
    tokenizer: PreTrainedTokenizerBase | Any,
    class_names: Sequence[str],
    templates: Sequence[Template],
    *,
    batch_size: int = 256,
    device: str | torch.device | None = None,
    task: str | None = None,
) -> ClipZeroShotHead:
    """Zero-shot head of one task from the text tower of ``clip_model``.

    Args:
        clip_model: the base ``CLIPModel`` (text tower, ``text_projection``, ``logit_scale``).
        tokenizer: its tokenizer, or a ``CLIPProcessor`` (its ``.tokenizer`` is used).
        class_names: class names in label order.
        templates: templates (``str`` with ``{c}`` or callables).
        batch_size: prompts per text forward pass (padding does not change the EOS-pooled
            embedding: CLIP's text attention is causal).
        device: device of the text forward passes; None: where ``clip_model`` is.
        task: task name stored in the head.

    Returns:
        A :class:`ClipZeroShotHead` (class embeddings in float32 on ``device``).
    """
    name = task or "custom"
    names = _check_class_names(name, class_names, "class_names")
    temps = _check_templates(name, templates, "templates")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not _has_text_tower(clip_model) or not hasattr(clip_model, "logit_scale"):
        raise TypeError(f"clip_model must be a CLIPModel (with a text tower), got {type(clip_model).__name__}")
    if not hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "tokenizer"):
        tokenizer = tokenizer.tokenizer
    run_device = torch.device(device) if device is not None else module_device(clip_model)

    prompts = [p for row in render_prompts(names, temps) for p in row]
    text_config = getattr(getattr(clip_model, "config", None), "text_config", None)
    max_length = getattr(text_config, "max_position_embeddings", None)
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < 10**6:
        max_length = model_max if max_length is None else min(max_length, model_max)

    towers = _zero_shot_towers(clip_model)
    chunks: list[torch.Tensor] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            emb = towers.encode_prompts(clip_model, tokenizer, prompts[start : start + batch_size], run_device,
                                        max_length).float()
            chunks.append(emb / emb.norm(dim=-1, keepdim=True))
        emb = torch.cat(chunks).reshape(len(names), len(temps), -1)
        class_embeddings = emb.mean(dim=1)
        class_embeddings = class_embeddings / class_embeddings.norm(dim=-1, keepdim=True)
        logit_scale = float(clip_model.logit_scale.detach().float().exp().item())
    return ClipZeroShotHead(class_embeddings.clone(), logit_scale, names, task)


# ----------------------------------------------------------------- vision side


def _zero_shot_towers(model: nn.Module) -> Any:
    """The layer map whose zero-shot tower API `model` has (`encode_prompts`, `image_embeddings`,
    `check_vision_model`): its own map's (open_clip's), else transformers CLIP's."""
    found = layer_map_or_none(model)
    return found if hasattr(found, "image_embeddings") else CLIPVisionLayerMap()


def _has_text_tower(model: nn.Module) -> bool:
    return _zero_shot_towers(model).has_text_tower(model)


def _check_vision_compat(vision_model: nn.Module, clip_model: nn.Module | None) -> None:
    _zero_shot_towers(vision_model).check_vision_model(vision_model, clip_model)


def clip_image_embeddings(
    vision_model: nn.Module, pixel_values: torch.Tensor, clip_model: CLIPModel | None = None
) -> torch.Tensor:
    """Projected (unnormalised) image embeddings ``[batch, projection_dim]``.

    ``CLIPModel``: ``get_image_features``; ``CLIPVisionModelWithProjection``: ``image_embeds``;
    bare ``CLIPVisionModel``: ``clip_model.visual_projection(pooler_output)``.
    """
    return _zero_shot_towers(vision_model).image_embeddings(vision_model, pixel_values, clip_model)


def vision_tower_into_clip(clip_model: CLIPModel, vision_model: nn.Module) -> CLIPModel:
    """A copy of ``clip_model`` whose vision tower has the weights of ``vision_model``.

    ``vision_model`` may be a ``CLIPVisionModel`` (only the tower is copied; the base
    ``visual_projection`` is kept), a ``CLIPVisionModelWithProjection`` or a ``CLIPModel``
    (tower and ``visual_projection`` are copied). ``clip_model`` itself is not modified.

    Raises:
        ValueError: the tower's parameters do not match ``clip_model.vision_model``.
    """
    if not hasattr(clip_model, "vision_model") or not hasattr(clip_model, "visual_projection"):
        raise TypeError(f"clip_model must be a CLIPModel, got {type(clip_model).__name__}")
    tower, projection = vision_parts(vision_model)
    out = copy.deepcopy(clip_model)
    try:
        out.vision_model.load_state_dict(tower.state_dict(), strict=True)
        if projection is not None:
            out.visual_projection.load_state_dict(projection.state_dict(), strict=True)
    except RuntimeError as exc:
        raise ValueError(f"vision_model does not match the vision tower of clip_model: {exc}") from exc
    return out


# ------------------------------------------------------------------------- data


def load_clip_split(
    task: ClipTask | str,
    split: str = CLIP_DEFAULT_SPLIT,
    dataset: Dataset | Any | PathLike | None = None,
) -> Dataset:
    """Load the evaluation split of one task.

    Args:
        task: a :class:`ClipTask` or the name of a built-in task.
        split: split name (default ``"test"``).
        dataset: optional local data instead of the Hub: a ``datasets.Dataset`` (used as is),
            a ``DatasetDict`` (``split`` is taken from it) or a ``save_to_disk`` path. Without
            it, ``datasets.load_dataset(path, config, split=split)`` is used.

    Raises:
        ValueError: a custom task without ``dataset``, a missing split or missing columns.
        FileNotFoundError: ``dataset`` is a path that does not exist.
    """
    import datasets as hf_datasets

    from ..data import images_from_column

    spec = task if isinstance(task, ClipTask) else resolve_clip_task(task, argument="task")
    if dataset is None:
        if spec.dataset_path is None:
            raise ValueError(
                f"datasets: custom task {spec.name!r} has no Hub dataset; pass datasets={{{spec.name!r}: <Dataset>}}"
            )
        ds = hf_datasets.load_dataset(spec.dataset_path, spec.dataset_config, split=split)
    else:
        ds = dataset
    ds = local_split(ds, split, f"datasets[{spec.name!r}]")
    for column, argument in ((spec.image_column, "image_column"), (spec.label_column, "label_column")):
        if column not in ds.column_names:
            raise ValueError(
                f"dataset of task {spec.name!r} lacks the {argument} {column!r}; it has columns {ds.column_names}"
            )
    ds = images_from_column(ds, spec.image_column, f"dataset of task {spec.name!r}")
    feature = ds.features.get(spec.label_column)
    num_classes = getattr(feature, "num_classes", None)
    if num_classes is not None and num_classes != spec.num_classes:
        raise ValueError(
            f"dataset of task {spec.name!r} has {num_classes} classes (ClassLabel of {spec.label_column!r}) "
            f"but class_names has {spec.num_classes}"
        )
    return ds


def _to_rgb(image: Any) -> Any:
    if hasattr(image, "convert"):
        return image.convert("RGB")
    try:
        import numpy as np
        from PIL import Image
    except ImportError:  # pragma: no cover
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    return image


class _ImageBatches(torch.utils.data.Dataset):
    """Batches of (pixel_values, labels), preprocessed on access (DataLoader workers can run this)."""

    def __init__(self, ds: Dataset, spec: ClipTask, image_processor: Any, batch_size: int) -> None:
        self.ds = ds
        self.spec = spec
        self.image_processor = image_processor
        self.batch_size = batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.ds) / self.batch_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.batch_size
        rows = self.ds[start : start + self.batch_size]
        images = [_to_rgb(im) for im in rows[self.spec.image_column]]
        labels = rows[self.spec.label_column]
        if any(isinstance(lab, bool) for lab in labels):
            labels = [int(lab) for lab in labels]
        bad = [lab for lab in labels if not isinstance(lab, int) or not 0 <= lab < self.spec.num_classes]
        if bad:
            raise ValueError(
                f"task {self.spec.name!r}: labels must be integers in [0, {self.spec.num_classes}) "
                f"(one per class name); got {bad[:5]!r}"
            )
        if hasattr(self.image_processor, "model_input_names"):  # a transformers image processor
            pixel_values = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        else:  # a per-image transform (open_clip's preprocess)
            pixel_values = torch.stack([self.image_processor(image) for image in images])
        return pixel_values, torch.tensor(labels, dtype=torch.long)


def _iterate(batches: _ImageBatches, num_workers: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if num_workers == 0:
        for i in range(len(batches)):
            yield batches[i]
    else:
        loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False, num_workers=num_workers)
        yield from loader


# ---------------------------------------------------------------------- results


@dataclass
class ClipZeroShotResults(EvaluationResults):
    """Top-1 accuracies of one zero-shot evaluation.

    Attributes:
        accuracy: per task, top-1 accuracy in [0, 1] (evaluation order).
        num_examples: per task, number of evaluated examples.
        predictions: per task, the predicted label of each example (not in :meth:`to_dict`
            unless asked).
    """

    accuracy: dict[str, float]
    num_examples: dict[str, int] = field(default_factory=dict)
    predictions: dict[str, list[int]] = field(default_factory=dict, repr=False)

    _columns = (("Accuracy", "---:"), ("N", "---:"))

    @property
    def scores(self) -> dict[str, float]:
        """Top-1 accuracy per task."""
        return self.accuracy

    def _task_name(self, task: str) -> str:
        return _known_task_name(task) or task

    def to_dict(self, include_predictions: bool = False) -> dict[str, Any]:
        """Plain-Python (JSON-serialisable) form."""
        out: dict[str, Any] = {
            "accuracy": dict(self.accuracy),
            "average": self.average,
            "num_examples": dict(self.num_examples),
        }
        if include_predictions:
            out["predictions"] = {t: list(p) for t, p in self.predictions.items()}
        return out

    def _cells(self, task: str, fmt: Callable[[float], str]) -> list[str]:
        return [fmt(self.accuracy[task]), str(self.num_examples.get(task, ""))]

    def to_markdown(self, percent: bool = True, digits: int = 2, wide: bool = False) -> str:
        """Markdown table of the accuracies and their mean.

        Args:
            percent: show percentages (default) instead of fractions.
            digits: decimals.
            wide: one column per task and a final ``Avg.`` column (the paper's layout) instead of
                one row per task.
        """
        if not wide:
            return super().to_markdown(percent, digits)
        fmt = self._formatter(percent, digits)
        header = "| " + " | ".join([*self.accuracy, "Avg."]) + " |"
        rule = "|" + "---:|" * (len(self.accuracy) + 1)
        row = "| " + " | ".join([*(fmt(v) for v in self.accuracy.values()), fmt(self.average)]) + " |"
        return "\n".join([header, rule, row])


# ------------------------------------------------------------------- evaluation


def _task_list(tasks: str | Iterable[str]) -> list[str]:
    if isinstance(tasks, str):
        tasks = [tasks]
    out = list(tasks)
    if not out:
        raise ValueError("tasks is empty")
    return out


def _check_mapping_keys(mapping: Mapping[str, Any] | None, argument: str, tasks: list[str]) -> dict[str, Any]:
    """Mapping keys canonicalised (aliases of built-in tasks); keys must be among ``tasks``."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{argument} must be a mapping task -> value, got {type(mapping).__name__}")
    canonical = {_known_task_name(t) or t for t in tasks}
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = _known_task_name(key) or key
        if name not in canonical:
            raise ValueError(f"{argument} has an entry for {key!r}, which is not among the evaluated tasks {tasks}")
        out[name] = value
    return out


def evaluate_clip_zeroshot(  # noqa: C901 - one branch per kind of vision model and per optional input
    vision_model: nn.Module,
    clip_model: CLIPModel | None,
    processor: Any,
    tasks: str | Iterable[str] = CLIP_TASKS,
    datasets: Mapping[str, Dataset | PathLike] | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    max_samples: int | None = None,
    split: str = CLIP_DEFAULT_SPLIT,
    *,
    class_names: Mapping[str, Sequence[str]] | None = None,
    templates: Mapping[str, Sequence[Template]] | None = None,
    text_batch_size: int = 256,
    num_workers: int = 0,
    progress: bool = False,
) -> ClipZeroShotResults:
    """Zero-shot top-1 accuracy of a CLIP vision model on the CLIP tasks.

    Args:
        vision_model: the model under evaluation: a ``CLIPModel``, a
            ``CLIPVisionModelWithProjection`` or a bare ``CLIPVisionModel`` (whose pooled output
            goes through ``clip_model.visual_projection``); or an open_clip ``CLIP`` /
            ``VisionTransformer``.
        clip_model: the base ``CLIPModel`` (e.g. ``openai/clip-vit-base-patch32``): its text tower
            builds the zero-shot heads and its ``visual_projection`` serves bare towers. None
            only when ``vision_model`` is itself a ``CLIPModel`` (its own text tower is used).
        processor: a ``CLIPProcessor``, or a ``(tokenizer, image_processor)`` pair (for open_clip:
            ``(open_clip.get_tokenizer(name), preprocess)``).
        tasks: one task name or several: built-in ones (:data:`CLIP_TASKS`) and/or custom ones
            given in ``class_names``.
        datasets: optional mapping task -> local ``datasets.Dataset`` / ``DatasetDict`` /
            ``save_to_disk`` path; other built-in tasks are loaded from the Hub.
        batch_size: images per forward pass.
        device: device to run on (both models are moved there); None keeps the models where
            they are (image inputs go to ``vision_model``'s device, prompts to ``clip_model``'s).
        max_samples: evaluate only the first ``max_samples`` examples of each task.
        split: split to evaluate (default ``"test"``).
        class_names: overrides / custom tasks: task -> class names in label order.
        templates: overrides / custom tasks: task -> templates (``str`` with ``{c}`` or
            callables); custom tasks default to :data:`CLIP_DEFAULT_TEMPLATES`.
        text_batch_size: prompts per text forward pass.
        num_workers: DataLoader workers for image decoding/preprocessing (0: in-process).
        progress: show a progress bar.

    Returns:
        :class:`ClipZeroShotResults` (per-task accuracy, plain mean, predictions).

    Raises:
        ValueError: unknown tasks, malformed overrides, missing columns/labels/datasets, or
            a vision tower that does not fit ``clip_model``.
    """
    from tqdm.auto import tqdm

    task_names = _task_list(tasks)
    class_names_map = _check_mapping_keys(class_names, "class_names", task_names)
    templates_map = _check_mapping_keys(templates, "templates", task_names)
    datasets_map = _check_mapping_keys(datasets, "datasets", task_names)
    specs: list[ClipTask] = []
    for task in task_names:
        name = _known_task_name(task) or task
        specs.append(resolve_clip_task(task, class_names_map.get(name), templates_map.get(name), argument="tasks"))
    seen = [s.name for s in specs]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ValueError(f"tasks lists {duplicates} more than once")
    for spec in specs:
        if spec.dataset_path is None and spec.name not in datasets_map:
            raise ValueError(
                f"datasets: custom task {spec.name!r} has no Hub dataset; pass datasets={{{spec.name!r}: <Dataset>}}"
            )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if text_batch_size < 1:
        raise ValueError(f"text_batch_size must be >= 1, got {text_batch_size}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")

    if not isinstance(vision_model, nn.Module):
        raise TypeError(f"vision_model must be a torch module (a CLIP vision model), got {type(vision_model).__name__}")
    if clip_model is None:
        if not _has_text_tower(vision_model):
            raise ValueError("clip_model is required unless vision_model is a full CLIPModel (with a text tower)")
        clip_model = vision_model  # type: ignore[assignment]
    if not _has_text_tower(clip_model):
        raise TypeError(f"clip_model must be a CLIPModel, got {type(clip_model).__name__}")
    _check_vision_compat(vision_model, clip_model)
    tokenizer, image_processor = _split_processor(processor)

    if device is not None:
        vision_model.to(device)
        clip_model.to(device)
    models = [vision_model] if clip_model is vision_model else [vision_model, clip_model]
    training = [m.training for m in models]
    for m in models:
        m.eval()
    image_device = module_device(vision_model)
    image_dtype = module_dtype(vision_model)

    results = ClipZeroShotResults(accuracy={})
    try:
        for spec in specs:
            ds = load_clip_split(spec, split=split, dataset=datasets_map.get(spec.name))
            if max_samples is not None and len(ds) > max_samples:
                ds = ds.select(range(max_samples))
            if len(ds) == 0:
                raise ValueError(f"the dataset of task {spec.name!r} (split {split!r}) is empty")
            ds = ds.select_columns([spec.image_column, spec.label_column])
            head = build_zeroshot_head(
                clip_model, tokenizer, spec.class_names, spec.templates, batch_size=text_batch_size, task=spec.name
            )
            head.class_embeddings = head.class_embeddings.to(image_device)
            batches = _ImageBatches(ds, spec, image_processor, batch_size)
            predictions: list[int] = []
            correct = 0
            for pixel_values, labels in tqdm(
                _iterate(batches, num_workers), total=len(batches), desc=f"CLIP {spec.name}", disable=not progress
            ):
                with torch.inference_mode():
                    embeds = clip_image_embeddings(
                        vision_model, pixel_values.to(device=image_device, dtype=image_dtype), clip_model
                    )
                    pred = head.logits(embeds).argmax(dim=-1).cpu()
                correct += int((pred == labels).sum())
                predictions.extend(pred.tolist())
            results.accuracy[spec.name] = correct / len(predictions)
            results.num_examples[spec.name] = len(predictions)
            results.predictions[spec.name] = predictions
    finally:
        for m, was_training in zip(models, training, strict=True):
            m.train(was_training)
    return results
