"""What the text families share (decoder LLMs, BERT-like encoders): calibration rows from a text column,
or from chat messages rendered by the base's chat template, tokenised by the base's tokenizer with
truncation to ``max_length``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .base import ModelFamily

if TYPE_CHECKING:  # pragma: no cover
    from ..recipes.spec import DatasetSpec

__all__ = ["DEFAULT_TEXT_COLUMN", "TextFamily", "tokenize_texts"]

#: The text column read when a dataset entry names neither ``text_column`` nor ``messages_column``.
DEFAULT_TEXT_COLUMN = "text"


class TextFamily(ModelFamily):
    """Families whose calibration data are texts, tokenised by the base's tokenizer."""

    #: ``messages_column`` only for families whose tokenizers carry chat templates.
    calibration_data_keys: ClassVar[tuple[str, ...]] = ("text_column", "messages_column", "max_length")

    def load_processing(self, source: str) -> dict[str, Any]:
        """The tokenizer saved with `source`; OSError when it has none."""
        from ..processing import tokenizer_of

        tokenizer = tokenizer_of(source)
        if tokenizer is None:
            raise OSError(f"{source!r} has no tokenizer files")
        return {"tokenizer": tokenizer}

    def calibration_processing_class(self, processing: Mapping[str, Any]) -> Any:
        """The tokenizer that pads the calibration batches: the base's, or a copy of it padding with its
        end-of-sequence token when it has no pad token (Llama's); padding weighs 0 either way. The saved
        tokenizer stays the base's, unchanged."""
        return padding_tokenizer(processing["tokenizer"])

    def complete_dataset_spec(self, v, task, spec, entry, key, substitute, keys, fallback) -> None:
        spec.text_column = v.string(substitute(entry.get("text_column")), key("text_column"), optional=True)
        spec.messages_column = v.string(substitute(entry.get("messages_column")), key("messages_column"),
                                        optional=True)
        if spec.text_column is not None and spec.messages_column is not None:
            raise v.error(key("messages_column"), "give either text_column or messages_column, not both")
        if "max_length" in entry:
            spec.max_length = v.integer(entry["max_length"], key("max_length"), 1, optional=True)

    def dataset_to_dict(self, spec: DatasetSpec, calibration: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if spec.messages_column is not None:
            out["messages_column"] = spec.messages_column
        else:
            out["text_column"] = spec.text_column or DEFAULT_TEXT_COLUMN
        if calibration:
            out["max_length"] = spec.max_length
        return out

    def inherit_from_calibration(self, entry: dict[str, Any], calibration: DatasetSpec) -> None:
        if "text_column" not in entry and "messages_column" not in entry:
            if calibration.messages_column is not None:
                entry["messages_column"] = calibration.messages_column
            elif calibration.text_column is not None:
                entry["text_column"] = calibration.text_column
        entry.setdefault("max_length", calibration.max_length)

    def prepare_calibration(self, task: str, ds: Any, spec: DatasetSpec, processing: Mapping[str, Any] | None) -> Any:
        """``input_ids`` and ``attention_mask`` of each row's text (or rendered messages), truncated to
        ``max_length`` tokens; padded per batch by the calibrator."""
        assert processing is not None
        return tokenize_texts(ds, spec, processing["tokenizer"], f"calibration.tasks.{task}")


def padding_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer`, or a copy that pads with its end-of-sequence token when it has no pad token."""
    if tokenizer.pad_token_id is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has neither a pad nor an end-of-sequence "
                         "token to pad calibration batches with; give the base a pad token")
    padded = copy.deepcopy(tokenizer)
    padded.pad_token = tokenizer.eos_token
    return padded


def texts_of(ds: Any, spec: DatasetSpec, tokenizer: Any, what: str) -> list[str]:
    """The texts of a dataset's rows: its ``text_column`` (default ``text``), or its ``messages_column``
    rendered by the tokenizer's chat template."""
    if spec.messages_column is not None:
        column = spec.messages_column
        if column not in ds.column_names:
            raise ValueError(f"{what}: the dataset has no messages column {column!r} (columns: {ds.column_names})")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{what}: messages_column needs a chat template, and the base's tokenizer "
                             f"({type(tokenizer).__name__}) has none; give text_column instead")
        texts = []
        for index, messages in enumerate(ds[column]):
            if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                         for m in messages):
                raise ValueError(f"{what}: row {index} of {column!r} is not a list of {{role, content}} messages")
            texts.append(tokenizer.apply_chat_template(list(messages), tokenize=False))
        return texts
    column = spec.text_column or DEFAULT_TEXT_COLUMN
    if column not in ds.column_names:
        raise ValueError(f"{what}: the dataset has no text column {column!r} (columns: {ds.column_names}); set "
                         "text_column (or messages_column for chat messages)")
    texts = ds[column]
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str) or not text), None)
    if bad is not None:
        raise ValueError(f"{what}: row {bad} of the text column {column!r} is not a non-empty string: {texts[bad]!r}")
    return list(texts)


def tokenize_texts(ds: Any, spec: DatasetSpec, tokenizer: Any, what: str) -> Any:
    """A ``Dataset`` of ``input_ids`` / ``attention_mask`` (unpadded, truncated to ``spec.max_length``)
    from the rows' texts. Rendered chat messages carry their own special tokens (none are added)."""
    import datasets

    texts = texts_of(ds, spec, tokenizer, what)
    encoded = tokenizer(texts, truncation=spec.max_length is not None, max_length=spec.max_length,
                        add_special_tokens=spec.messages_column is None)
    return datasets.Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
