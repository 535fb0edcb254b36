"""Calibration data: turn a `datasets.Dataset` or an iterable of batches into a list of batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import default_data_collator

try:  # `datasets` is a dependency, but keep the import local to what needs it
    from datasets import Dataset
except ImportError:  # pragma: no cover
    Dataset = None

Batch = dict[str, Any]

#: Consecutive empty batches after which an iterable is refused (it may never yield an example).
MAX_CONSECUTIVE_EMPTY_BATCHES = 1000

#: Columns taken for images, in this order, when none is named (calibration data, recipes' datasets).
IMAGE_COLUMNS = ("image", "img", "images")
_TEXT_COLUMNS = ("text", "sentence", "input_text")


def images_from_column(dataset: Any, column: str, what: str) -> Any:
    """`dataset` with `column` holding images: a `datasets.Image` column as it is, a column of image
    file paths (strings) cast to `datasets.Image` (opened with PIL when read; relative paths from the
    working directory; every local path checked now); a column of anything else (ints, arrays) is
    refused with a ValueError naming `what` and the column, before any work."""
    import os

    from datasets import Image, Value

    feature = (getattr(dataset, "features", None) or {}).get(column)
    if feature is None or isinstance(feature, Image):
        return dataset
    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        missing = [p for p in dataset[column] if not isinstance(p, str) or not (os.path.isfile(p) or "://" in p)]
        if missing:
            raise ValueError(
                f"{what}: the image column {column!r} holds file paths, but {len(missing)} of them are no file "
                f"(e.g. {missing[0]!r}; relative paths are read from the working directory {os.getcwd()!r})"
            )
        return dataset.cast_column(column, Image())
    kind = f"{feature.dtype} values" if isinstance(feature, Value) else f"{type(feature).__name__} values ({feature})"
    raise ValueError(
        f"{what}: the image column {column!r} holds {kind[:120]}, not images: give a datasets.Image column "
        "(e.g. PIL images) or image file paths (strings), or name the image column with image_column"
    )


def batch_size_of(batch: Mapping[str, Any], main_input_name: str) -> int:
    """Number of examples in a batch: the leading dimension of its main input."""
    if main_input_name not in batch:
        raise ValueError(f"the batch has no tensor '{main_input_name}' (keys: {sorted(batch)})")
    value = batch[main_input_name]
    if not isinstance(value, Tensor):
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise ValueError(
            f"the batch's '{main_input_name}' is a {kind}, expected a torch.Tensor (convert it with torch.as_tensor)"
        )
    if value.dim() == 0:
        raise ValueError(f"the batch's '{main_input_name}' is a 0-dimensional tensor, expected one example per row")
    return int(value.shape[0])


def cut_batch(batch: Mapping[str, Any], size: int, keep: int) -> Batch:
    """The first `keep` examples of a batch of `size` (tensors with that leading dimension are cut)."""
    return {
        k: (v[:keep] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == size else v) for k, v in batch.items()
    }


def rest_of_batch(batch: Mapping[str, Any], size: int, skip: int) -> Batch:
    """A batch of `size` without its first `skip` examples (what `cut_batch(batch, size, skip)` leaves)."""
    return {
        k: (v[skip:] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == size else v) for k, v in batch.items()
    }


def prepare_batches(
    task: str,
    data: Any,
    *,
    main_input_name: str,
    num_samples: int | None,
    batch_size: int,
    seed: int,
    data_collator: Callable[[list[dict]], Batch] | None = None,
    processing_class: Any = None,
    max_length: int | None = None,
) -> list[Batch]:
    """The calibration batches of one task.

    An iterable is used as given (each item one batch, examples taken in order, the last batch cut so
    that at most `num_samples` are used). A `datasets.Dataset` gives `sample_examples(data, num_samples,
    seed)` (all rows in order with None, else `num_samples` drawn with `seed`), batched by `batch_size`
    through `data_collator` and/or `processing_class`; a
    text column tokenised by `processing_class` is truncated to `max_length` tokens (None: not truncated).
    """
    if Dataset is not None and isinstance(data, Dataset):
        return _batches_from_dataset(
            task, data, main_input_name, num_samples, batch_size, seed, data_collator, processing_class, max_length
        )
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(
            f"calibration_data[{task!r}] must be a datasets.Dataset or an iterable of batches "
            f"(dicts of tensors), got {type(data).__name__}."
        )
    if num_samples is None and not _has_length(data):
        # every batch is kept in memory: an endless stream would never finish
        raise ValueError(
            f"calibration_data[{task!r}] is a {type(data).__name__} without a length, and "
            "FeatCalConfig.num_samples_per_task is None: set num_samples_per_task to bound how much is read, "
            "or pass a list of batches."
        )
    batches: list[Batch] = []
    used = 0
    empty_run = 0
    for index, batch in enumerate(data):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"calibration_data[{task!r}] item {index} must be a batch: a dict of tensors such as "
                f"{{'{main_input_name}': tensor}}, got {type(batch).__name__}."
            )
        try:
            size = batch_size_of(batch, main_input_name)
        except ValueError as err:
            raise ValueError(f"calibration_data[{task!r}] item {index}: {err}") from None
        if size == 0:
            empty_run += 1
            if empty_run >= MAX_CONSECUTIVE_EMPTY_BATCHES:
                raise ValueError(
                    f"calibration_data[{task!r}] yielded {empty_run} empty batches in a row (items "
                    f"{index - empty_run + 1}-{index}, none with an example): give batches with examples."
                )
            continue
        empty_run = 0
        if num_samples is not None and used + size > num_samples:
            batches.append(cut_batch(batch, size, num_samples - used))
            used = num_samples
            break
        batches.append(dict(batch))
        used += size
        if num_samples is not None and used >= num_samples:
            break
    return batches


def _has_length(data: Any) -> bool:
    try:
        len(data)
    except TypeError:
        return False
    return True


def sample_examples(dataset: Any, num_samples: int | None, seed: int) -> Any:
    """The examples of a `datasets.Dataset` a calibration uses: with `num_samples` None all of them, in
    their order (FeatCal's statistics are sums over every token, so the order only moves round-off);
    else `num_samples` of them drawn with `seed` (one shuffle, then the first ones). The one sampling
    rule: recipes draw with it before preparing rows (so only the drawn ones are tokenised) and hand
    the calibrator the result with `num_samples_per_task=None`, so their data are sampled once."""
    if num_samples is None:
        return dataset
    dataset = dataset.shuffle(seed=seed)
    return dataset.select(range(num_samples)) if num_samples < len(dataset) else dataset


def _batches_from_dataset(
    task: str,
    dataset: Any,
    main_input_name: str,
    num_samples: int | None,
    batch_size: int,
    seed: int,
    data_collator: Callable | None,
    processing_class: Any,
    max_length: int | None = None,
) -> list[Batch]:
    if len(dataset) == 0:
        return []
    dataset = sample_examples(dataset, num_samples, seed)
    batches = []
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batches.append(collate(task, rows, main_input_name, data_collator, processing_class, max_length))
    return batches


def collate(
    task: str,
    rows: list[dict],
    main_input_name: str,
    data_collator: Callable | None,
    processing_class: Any,
    max_length: int | None = None,
) -> Batch:
    """Turn dataset rows into a batch: the processor first (images, or text truncated to `max_length`
    tokens), then the collator."""
    if processing_class is not None and main_input_name not in rows[0]:
        rows = _process(task, rows, processing_class, max_length)
    elif data_collator is None and main_input_name not in rows[0]:
        # the default collator would fail on the raw column ("Could not infer dtype of PngImageFile")
        raise ValueError(
            f"calibration_data[{task!r}]: its rows have no {main_input_name!r} (columns: {sorted(rows[0])}) and no "
            "`processing_class` was given to make it from them: pass processing_class=<the model's image processor, "
            f"per-image transform or tokenizer>, or give rows with {main_input_name!r} (or a `data_collator` that "
            "makes it)."
        )
    if data_collator is None:
        # as `Trainer` drops unused columns: raw text (e.g. a prompt kept beside its token ids) is no input
        rows = [{k: v for k, v in row.items() if not _is_text(v)} for row in rows]
    collator = data_collator or _default_collator(rows, processing_class)
    batch = collator(rows)
    if not isinstance(batch, Mapping):
        raise TypeError(f"the data collator returned {type(batch).__name__} for task {task!r}; expected a dict")
    return {k: (torch.as_tensor(v) if isinstance(v, list) else v) for k, v in dict(batch).items()}


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], str))


def _process(task: str, rows: list[dict], processing_class: Any, max_length: int | None = None) -> list[dict]:
    image_column = next((c for c in IMAGE_COLUMNS if c in rows[0]), None)
    text_column = next((c for c in _TEXT_COLUMNS if c in rows[0]), None)
    if image_column is not None and hasattr(processing_class, "preprocess"):
        out = processing_class(images=[r[image_column] for r in rows], return_tensors="pt")
    elif image_column is not None and not hasattr(processing_class, "tokenize"):
        # a per-image transform (open_clip's / torchvision's preprocess): PIL image → tensor
        return [{"pixel_values": processing_class(r[image_column])} for r in rows]
    elif text_column is not None:
        out = processing_class(
            [r[text_column] for r in rows], return_tensors="pt", padding=True,
            truncation=max_length is not None, max_length=max_length,
        )
    else:
        raise ValueError(
            f"calibration_data[{task!r}]: the processing_class needs an image column {IMAGE_COLUMNS} or a "
            f"text column {_TEXT_COLUMNS}; the dataset has {sorted(rows[0])}."
        )
    keys = list(out.keys())
    return [{k: out[k][i] for k in keys} for i in range(len(rows))]


#: A tokenizer's `model_max_length` at or above this is transformers' "no limit known" placeholder.
_UNKNOWN_TOKENIZER_LIMIT = 10**12


def text_length_limit(max_length: int | None, model_config: Any, processing_class: Any) -> int | None:
    """The length texts are truncated to: `max_length` when set, else the model's maximum, the smaller
    of `model_config.max_position_embeddings` and the tokenizer's `model_max_length` where known
    (a tokenizer built without one reports a huge placeholder); None when neither is known."""
    if max_length is not None:
        return max_length
    known = [
        value
        for value in (getattr(model_config, "max_position_embeddings", None),
                      getattr(processing_class, "model_max_length", None))
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _UNKNOWN_TOKENIZER_LIMIT
    ]
    return min(known) if known else None


def _default_collator(rows: list[dict], processing_class: Any) -> Callable[[list[dict]], Batch]:
    """As `Trainer` does: pad with the tokenizer when there is one (labels padded with -100),
    else stack with transformers' `default_data_collator`."""
    if processing_class is not None and getattr(processing_class, "pad_token_id", None) is not None:
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

        if "labels" in rows[0]:
            return DataCollatorForSeq2Seq(processing_class, return_tensors="pt")
        return DataCollatorWithPadding(processing_class, return_tensors="pt")
    return default_data_collator
