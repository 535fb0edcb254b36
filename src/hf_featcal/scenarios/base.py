"""What every offline merging scenario shares: the `MergingScenario` base class (a base model, one expert
per task, their Task-Arithmetic merge) and the build cache (models written atomically next to a key
describing how they were built, found again only when the key matches)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

KEY_FILE = "scenario.json"

Built = TypeVar("Built")


class MergingScenario:
    """Base of the built scenarios (dataclasses with ``base`` and ``experts`` fields): the Task-Arithmetic
    merge of the experts; subclasses score a model with `evaluate`."""

    base: Any
    experts: dict[str, Any]

    def evaluate(self, model: Any, **kwargs: Any) -> dict[str, float]:
        """Per-task scores of `model` on the scenario's test data."""
        raise NotImplementedError

    def task_arithmetic(self, scaling_factor: float = 0.3) -> Any:
        """The Task-Arithmetic merge of the experts into the base (a new model)."""
        from ..merging import task_arithmetic

        return task_arithmetic(self.base, self.experts, scaling_factor=scaling_factor)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or notices from transformers while tiny models are saved or loaded."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def matching_build(path: str | os.PathLike, key: Mapping[str, Any]) -> bool:
    """Whether `path` holds a complete build made with `key`."""
    file = os.path.join(os.fspath(path), KEY_FILE)
    if not os.path.isfile(file):
        return False
    with open(file, encoding="utf-8") as handle:
        return json.load(handle) == json.loads(json.dumps(key))


def save_build(
    path: str | os.PathLike,
    key: Mapping[str, Any],
    models: Mapping[str, Any],
    write_extra: Callable[[str], None] | None = None,
) -> None:
    """Write `models` (sub-folder → model with `save_pretrained`), whatever `write_extra(folder)` adds
    and the key into a temporary folder beside `path`, then rename it into place: a reader never sees
    a half-written build (when two builders race, the first rename wins)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        with quiet_transformers():
            for name, model in models.items():
                model.save_pretrained(os.path.join(tmp, name))
        if write_extra is not None:
            write_extra(tmp)
        with open(os.path.join(tmp, KEY_FILE), "w", encoding="utf-8") as handle:
            json.dump(key, handle, indent=2, sort_keys=True)
        if os.path.isdir(path):  # a build with another key, or an incomplete leftover
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if not matching_build(path, key):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def load_models(load: Callable[[str], Any], path: str | os.PathLike, folders: Mapping[str, str]) -> dict[str, Any]:
    """``{name: load(path/folder)}`` for every entry of `folders`, quietly, each model in eval mode."""
    with quiet_transformers():
        return {name: load(os.path.join(os.fspath(path), folder)).eval() for name, folder in folders.items()}


def build_or_load(
    path: str | os.PathLike | None,
    key: Mapping[str, Any],
    build: Callable[[], Built],
    save: Callable[[str, Built], None],
    load: Callable[[str], Built],
) -> tuple[Built, bool]:
    """The scenarios' cache skeleton: ``(load(path), True)`` when `path` holds a build made with `key`,
    else ``(build(), False)``, saved with ``save(path, built)`` when a `path` is given (a build with
    another key there is replaced). Without a `path` nothing is cached."""
    if path is not None and matching_build(path, key):
        return load(os.fspath(path)), True
    built = build()
    if path is not None:
        save(os.fspath(path), built)
    return built, False
