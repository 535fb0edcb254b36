"""On-disk caching of the built offline scenarios (`toy`, `toy_text`, `toy_causal`): models written atomically
next to a key describing how they were built, found again only when the key matches."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

KEY_FILE = "scenario.json"


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


def save_scenario_build(
    path: str | os.PathLike, key: Mapping[str, Any], tokenizer: Any, base: Any, experts: Mapping[str, Any]
) -> None:
    """`save_build` of a text scenario: ``base/``, ``expert_<task>/`` and ``tokenizer/``."""
    models = {"base": base, **{f"expert_{task}": expert for task, expert in experts.items()}}
    save_build(path, key, models, lambda folder: tokenizer.save_pretrained(os.path.join(folder, "tokenizer")))
