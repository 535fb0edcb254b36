"""Resolving a user-given evaluation dataset: a `Dataset`, a `DatasetDict` or a `save_to_disk` path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def local_split(dataset: Any, split: str, what: str) -> Any:
    """The `split` of a local dataset; `what` names it in errors (e.g. "datasets['eurosat']")."""
    import datasets as hf_datasets

    if isinstance(dataset, (str, os.PathLike)):
        if not Path(dataset).exists():
            raise FileNotFoundError(f"{what}: path {str(dataset)!r} does not exist")
        dataset = hf_datasets.load_from_disk(str(dataset))
    if isinstance(dataset, hf_datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{what}: split={split!r} is not in the DatasetDict; it has {list(dataset)}")
        dataset = dataset[split]
    if not isinstance(dataset, hf_datasets.Dataset):
        raise TypeError(f"{what} must be a datasets.Dataset, got {type(dataset).__name__}")
    return dataset
