"""Which processing classes a saved model folder needs, and where they are found when not given.

A folder that downstream tools take as it is (`pipeline(...)`, lm-evaluation-harness, mergekit-style
copies) needs the tokenizer of a model that reads text: without it transformers' zero-shot image
pipeline on a CLIP folder returns uniform scores and raises nothing. `with_tokenizer` completes what
the caller gives from the sources the model came from (the base first), or refuses, naming what is
missing. `processing_classes_of` loads what a checkpoint folder or hub id was saved with, as mergekit
copies the base's tokenizer next to a merge.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MissingTokenizerError",
    "carries_tokenizer",
    "describe_processing",
    "has_tokenizer_files",
    "processing_classes_of",
    "reads_text",
    "tokenizer_of",
    "with_tokenizer",
]

#: What loading a processing class from a source that has none raises (transformers and the hub).
_NOT_FOUND = (OSError, ValueError, TypeError, KeyError, AttributeError)


class MissingTokenizerError(ValueError):
    """A save of a model that reads text, without a tokenizer given or found with its sources."""


def reads_text(model: Any) -> bool:
    """Whether `model` is a transformers model whose forward takes token ids (a CLIPModel, T5, BERT, a
    decoder LLM; not a bare vision tower). open_clip models record their tokenizer in their own config."""
    if getattr(model, "config", None) is None or not hasattr(model, "save_pretrained"):
        return False
    try:
        return "input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def carries_tokenizer(processing_class: Any) -> bool:
    """Whether `processing_class` (one class or a sequence) is or holds a tokenizer (a processor's
    ``tokenizer``)."""
    from transformers import PreTrainedTokenizerBase

    items = processing_class if isinstance(processing_class, (list, tuple)) else [processing_class]
    return any(isinstance(item, PreTrainedTokenizerBase)
               or isinstance(getattr(item, "tokenizer", None), PreTrainedTokenizerBase) for item in items)


#: Files one of which every saved tokenizer has (transformers' ``save_pretrained`` writes the first two;
#: older checkpoints may hold only their vocabulary).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")


def has_tokenizer_files(source: str) -> bool:
    """Whether `source` (a folder, or a hub id: its cache or the hub) holds a tokenizer's files. Checked
    before loading: transformers 5 builds an empty tokenizer (a vocabulary of its special tokens) for a
    folder that has none, which would save and load without an error and tokenise everything to unknown."""
    from transformers.utils import cached_file

    for name in TOKENIZER_FILES:
        try:
            if cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False) is not None:
                return True
        except _NOT_FOUND:
            continue
    return False


def tokenizer_of(source: str) -> Any:
    """The tokenizer saved with `source` (a folder or hub id), None when it has none."""
    from transformers import AutoTokenizer

    if not has_tokenizer_files(source):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no tokenizer files" notices: None says it
        try:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        except _NOT_FOUND:
            return None


def processing_classes_of(source: str) -> list[Any]:
    """What `source` (a folder or hub id) was saved with: its processor when it has one (tokenizer and
    image processor together), else its tokenizer and / or image processor; [] when none."""
    from transformers import AutoImageProcessor, AutoProcessor, ProcessorMixin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = None
        if has_tokenizer_files(source):  # else a processor would hold an empty tokenizer (`has_tokenizer_files`)
            try:
                processor = AutoProcessor.from_pretrained(source, trust_remote_code=False)
            except _NOT_FOUND:
                pass
        if isinstance(processor, ProcessorMixin):
            return [processor]
        found = [] if processor is None else [processor]  # AutoProcessor falls back to a tokenizer / image processor
        if not carries_tokenizer(found):
            tokenizer = tokenizer_of(source)
            found += [] if tokenizer is None else [tokenizer]
        if not any(_is_image_processor(item) for item in found):
            try:
                found.append(AutoImageProcessor.from_pretrained(source, trust_remote_code=False))
            except _NOT_FOUND:
                pass
    return found


def describe_processing(items: Sequence[Any]) -> str:
    """What `items` are, in words ("tokenizer + image processor"), for messages."""
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    def kind(item: Any) -> str:
        if isinstance(item, ProcessorMixin):
            return f"processor ({type(item).__name__})"
        if isinstance(item, PreTrainedTokenizerBase):
            return "tokenizer"
        return "image processor" if _is_image_processor(item) else type(item).__name__

    return " + ".join(kind(item) for item in items)


def _is_image_processor(item: Any) -> bool:
    from transformers.image_processing_base import ImageProcessingMixin

    return isinstance(item, ImageProcessingMixin)


def with_tokenizer(model: Any, processing_class: Any, sources: Sequence[tuple[str, str | None]],
                   argument: str = "processing_class") -> Any:
    """`processing_class` as given when the model reads no text or it carries a tokenizer; else it plus
    the tokenizer of the first of `sources` (``(what, folder or hub id)``, the base first) that has one.

    Raises:
        MissingTokenizerError: the model reads text and no tokenizer was given nor found, naming the
            model class, what was given and where a tokenizer was looked for.
    """
    if not reads_text(model) or carries_tokenizer(processing_class):
        return processing_class
    looked = []
    for what, source in sources:
        if not source:
            continue
        looked.append(f"{what} ({source})")
        tokenizer = tokenizer_of(source)
        if tokenizer is not None:
            given = [] if processing_class is None else (
                list(processing_class) if isinstance(processing_class, (list, tuple)) else [processing_class])
            return [*given, tokenizer]
    given_text = "nothing" if processing_class is None else " + ".join(
        type(p).__name__ for p in (processing_class if isinstance(processing_class, (list, tuple))
                                   else [processing_class]))
    where = ", ".join(looked) if looked else "no folder or hub id of the base or the model is known"
    raise MissingTokenizerError(
        f"{type(model).__name__} reads text, so its folder needs a tokenizer (without one, e.g. "
        f"pipeline('zero-shot-image-classification') scores every label alike), but `{argument}` gave {given_text} "
        f"and none was found with {where}: pass the tokenizer, e.g. {argument}=[image_processor, tokenizer] or "
        "the model's processor."
    )
