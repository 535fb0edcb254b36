"""Saving a model folder that downstream tools take as it is: the model, its processing classes and
whatever else the caller writes, put in place atomically.

Everything is written into a temporary sibling folder, then put in place by renames only: a failure
while writing (a full disk, an interrupt) leaves the previous folder, or nothing, at the target, never a
partial one, and no shard or index of an earlier save survives beside the new weights. A new target is
the temporary folder renamed; into an existing one the files are swapped (see `atomic_folder`), so other
content there (the user's, another process's) is kept.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from .interrupts import interrupts_deferred

logger = logging.getLogger(__name__)

#: Files a model save writes (weights, shard indexes, configs, tokenizer / processor files, model card,
#: open_clip files, hf_featcal's own outputs). Saving into an existing folder replaces all of these (so
#: no stale shard or index is left) and leaves every other entry alone.
MODEL_FOLDER_PATTERNS: tuple[str, ...] = (
    "*.safetensors", "*.index.json", "pytorch_model*.bin", "tf_model*.h5", "flax_model*.msgpack",
    "config.json", "generation_config.json", "README.md", ".gitattributes",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model",
    "*.tiktoken", "chat_template.jinja", "chat_template.json", "additional_chat_templates",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "open_clip_config.json", "open_clip_pytorch_model.bin",
    "featcal_*",
)

#: Remote files a new upload replaces: the weight files and indexes transformers / open_clip write (shards
#: of an earlier upload that this one does not rewrite are deleted with them; other files are kept).
STALE_WEIGHT_PATTERNS: list[str] = [
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
    "open_clip_model.safetensors", "open_clip_pytorch_model.bin",
]


def _is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FOLDER_PATTERNS)


def check_output_dir(output_dir: str | os.PathLike, argument: str = "output_dir") -> str:
    """The absolute target path, after checking that a model folder can be put there (it is absent or a
    folder, and the folder or its first existing parent is writable). Raises a TypeError / ValueError
    naming `argument` otherwise. Nothing is created."""
    if not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir):
        raise TypeError(f"`{argument}` must be a folder path, got {output_dir!r}.")
    target = os.path.realpath(os.fspath(output_dir))  # a symlinked output folder: fill what it points to
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"`{argument}` {os.fspath(output_dir)!r} is a file, not a folder.")
    parent = os.path.dirname(target)
    while not os.path.isdir(parent):  # missing parents are created on saving: the first existing one must be writable
        if os.path.exists(parent):
            raise ValueError(f"`{argument}` {os.fspath(output_dir)!r}: {parent!r} is a file, not a folder.")
        parent = os.path.dirname(parent)
    for folder in ([target] if os.path.isdir(target) else []) + [parent]:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"`{argument}` {os.fspath(output_dir)!r}: {folder!r} is not writable.")
    return target


@contextlib.contextmanager
def atomic_folder(output_dir: str | os.PathLike, argument: str = "output_dir") -> Iterator[str]:
    """Yield an empty temporary folder beside `output_dir`; when the block finishes, its content is put
    in place by renames only (no data is written then). When the block raises, the temporary folder is
    removed and `output_dir` is left exactly as it was.

    A new (or empty) `output_dir` is the temporary folder renamed: all or nothing. Into an existing
    folder, the earlier save's files (weights, shards, indexes, configs, tokenizer, card, hf_featcal
    outputs: `MODEL_FOLDER_PATTERNS`) are renamed aside, the new ones renamed in, then the old ones
    deleted; any other entry (yours, another process's) is left as it is."""
    target = check_output_dir(output_dir, argument)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = _sibling(target, "saving")
    os.mkdir(staging)  # with the usual permissions (tempfile.mkdtemp's would be private)
    try:
        yield staging
        _put_in_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _sibling(target: str, purpose: str) -> str:
    """A fresh hidden name beside `target` (same file system, so renames between them are atomic)."""
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.{purpose}-{uuid.uuid4().hex[:12]}")


def _put_in_place(staging: str, target: str) -> None:
    if os.path.isdir(target):
        with contextlib.suppress(OSError):  # not empty: the files are swapped in below
            os.rmdir(target)
    if not os.path.exists(target):
        try:
            os.rename(staging, target)
            return
        except OSError:
            if not os.path.isdir(target):  # not created meanwhile by another process: a real failure
                raise
    _swap_files(staging, target)


def _swap_files(staging: str, target: str) -> None:
    """Rename the earlier save's files of `target` aside, those of `staging` in, then delete the old ones;
    on a failure, rename everything back (SIGINT deferred meanwhile: see `interrupts_deferred`)."""
    new = os.listdir(staging)
    old = [name for name in os.listdir(target) if _is_model_file(name) or name in new]
    previous = _sibling(target, "previous")
    os.mkdir(previous)
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in old:
            os.rename(os.path.join(target, name), os.path.join(previous, name))
            moved_out.append(name)
        for name in new:
            os.rename(os.path.join(staging, name), os.path.join(target, name))
            moved_in.append(name)
    except BaseException:
        with interrupts_deferred():  # a second Ctrl-C waits until the folder is back as it was
            for name in reversed(moved_in):
                os.rename(os.path.join(target, name), os.path.join(staging, name))
            for name in reversed(moved_out):
                os.rename(os.path.join(previous, name), os.path.join(target, name))
            with contextlib.suppress(OSError):
                os.rmdir(previous)  # empty once everything is back (else it keeps the old files: never deleted)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    os.rmdir(staging)


def save_processing_class(processing_class: Any, output_dir: str, model: nn.Module | None = None) -> list[str]:
    """Save `processing_class` (a tokenizer, image processor or processor; or a sequence of them) into
    `output_dir` with its own `save_pretrained`, so the folder loads with the Auto classes and
    `pipeline(...)`. Returns the class names saved.

    open_clip keeps its preprocessing in `open_clip_config.json` (written with the model when its open_clip
    config is known): its transforms and tokenizers, which have no `save_pretrained`, need nothing here.
    Anything else that cannot be saved is reported with a warning."""
    if processing_class is None:
        return []
    if isinstance(processing_class, (list, tuple)):
        return [saved for item in processing_class for saved in save_processing_class(item, output_dir, model)]
    if hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
        return [type(processing_class).__name__]
    if _recorded_with_model(processing_class, output_dir, model):
        return []
    warnings.warn(
        f"processing_class {type(processing_class).__name__} has no save_pretrained: it is not saved with the model.",
        stacklevel=3,
    )
    return []


def _recorded_with_model(processing_class: Any, output_dir: str, model: nn.Module | None) -> bool:
    """Whether a family's model files already record `processing_class` (open_clip: a torchvision
    transform or an open_clip tokenizer, whose settings are in open_clip_config.json)."""
    from .architectures.families import iter_families

    return any(family.processing_recorded_with_model(processing_class, output_dir, model) for family in iter_families())


def save_model_files(
    model: nn.Module, output_dir: str, *, processing_class: Any = None, layer_map: Any = None
) -> list[str]:
    """Write `model` the way its library loads it back (transformers: `save_pretrained`; open_clip:
    its own format) and its processing classes into `output_dir`; returns the processing classes saved.
    Used inside `atomic_folder`, by `FeatCalCalibrator.save_model` and the CLI alike."""
    if layer_map is not None:
        layer_map.save_model(model, output_dir)
    elif hasattr(model, "save_pretrained"):
        model.save_pretrained(output_dir)
    else:  # open_clip: its own format
        from .architectures import get_layer_map

        get_layer_map(model, "model").save_model(model, output_dir)
    return save_processing_class(processing_class, output_dir, model)


def processing_to_save(processing: Any) -> list[Any]:
    """From the CLI / recipes' processing classes (`recipes.load_processing`): what is saved with the
    model — the CLIPProcessor (else the image processor) and the tokenizer; open_clip's
    ``(tokenizer, preprocess)`` pair (recorded in `open_clip_config.json`) as it is."""
    if processing is None:
        return []
    out: list[Any] = []
    processor = processing.get("processor")
    if isinstance(processor, tuple):
        return list(processor)
    if processor is not None:
        out.append(processor)
    elif processing.get("image") is not None:
        out.append(processing["image"])
    if processing.get("tokenizer") is not None:
        out.append(processing["tokenizer"])
    return out


__all__: Sequence[str] = [
    "MODEL_FOLDER_PATTERNS",
    "STALE_WEIGHT_PATTERNS",
    "atomic_folder",
    "check_output_dir",
    "processing_to_save",
    "save_model_files",
    "save_processing_class",
]
