"""What every offline merging scenario shares: the `MergingScenario` base class (a base model, one expert
per task, their Task-Arithmetic merge), the `ScenarioSettings` base of the settings dataclasses (checked
overrides, the hash that names a cache folder), the build cache (models written atomically next to a key
describing how they were built, found again only when the key matches), the linear task heads' file and
the reproducible training context."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

KEY_FILE = "scenario.json"
HEADS_FILE = "heads.safetensors"

Built = TypeVar("Built")


class MergingScenario:
    """Base of the built scenarios (dataclasses with ``base`` and ``experts`` fields): the Task-Arithmetic
    merge of the experts; subclasses score a model with `evaluate`."""

    base: Any
    experts: dict[str, Any]

    @property
    def tasks(self) -> list[str]:
        """Task names, in order."""
        return list(self.experts)

    def evaluate(self, model: Any, **kwargs: Any) -> dict[str, float]:
        """Per-task scores of `model` on the scenario's test data."""
        raise NotImplementedError

    def task_arithmetic(self, scaling_factor: float = 0.3) -> Any:
        """The Task-Arithmetic merge of the experts into the base (a new model)."""
        from ..merging import task_arithmetic

        return task_arithmetic(self.base, self.experts, scaling_factor=scaling_factor)


Settings = TypeVar("Settings", bound="ScenarioSettings")


class ScenarioSettings:
    """Base of the scenarios' frozen settings dataclasses (every field determines a build; ``seed`` and
    ``tasks`` are fields of each). A subclass sets `cache_name` (the cache folder's prefix) and
    `cache_format` (bumped when its build recipe changes, to invalidate old caches)."""

    cache_name: ClassVar[str]
    cache_format: ClassVar[int]

    @classmethod
    def from_arguments(cls: type[Settings], seed: int, tasks: Sequence[str], overrides: Mapping[str, Any]) -> Settings:
        """The settings of a ``build_*_scenario(seed, tasks=..., **overrides)`` call; an override that is
        not a field is refused, naming the valid ones."""
        fields = sorted(field.name for field in dataclasses.fields(cls))  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"unknown scenario settings {unknown}; valid: {fields}")
        return cls(seed=seed, tasks=tuple(tasks), **overrides)  # type: ignore[call-arg]

    def cache_key(self) -> str:
        """A short hash of the settings (and of the build recipe's version)."""
        payload = json.dumps({"format": self.cache_format, **dataclasses.asdict(self)}, sort_keys=True)  # type: ignore[call-overload]
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def cache_path(self, cache_dir: str | os.PathLike | None) -> str | None:
        """``cache_dir/<cache_name>-<cache_key()>``, or None without a `cache_dir`."""
        if cache_dir is None:
            return None
        return os.path.join(os.fspath(cache_dir), f"{self.cache_name}-{self.cache_key()}")


@contextlib.contextmanager
def reproducible_training() -> Iterator[None]:
    """One intra-op thread and a forked global torch RNG while models are built: the tiny matmuls gain
    nothing from more threads, a fixed thread count keeps the float reductions (hence the models)
    reproducible, and the caller's RNG state is left untouched."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)


def task_generator(seed: int, task_index: int) -> Any:
    """Seed the global torch RNG with a task's own seed and return a generator on that seed: each task
    draws from its own stream, so its models do not depend on which other tasks are built."""
    import torch

    task_seed = seed * 1000 + 1 + task_index
    torch.manual_seed(task_seed)
    return torch.Generator().manual_seed(task_seed)


def save_heads(folder: str, heads: Mapping[str, Any]) -> None:
    """The linear task heads (``nn.Linear`` with bias) as ``<task>.weight`` / ``<task>.bias`` in
    `folder`/``HEADS_FILE``."""
    from safetensors.torch import save_file

    tensors = {}
    for task, head in heads.items():
        tensors[f"{task}.weight"] = head.weight.detach().contiguous()
        tensors[f"{task}.bias"] = head.bias.detach().contiguous()
    save_file(tensors, os.path.join(folder, HEADS_FILE))


def load_heads(folder: str, tasks: Sequence[str]) -> dict[str, Any]:
    """The heads of `tasks` written by `save_heads`, as ``nn.Linear`` modules in eval mode."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, HEADS_FILE))
    heads = {}
    for task in tasks:
        weight, bias = tensors[f"{task}.weight"], tensors[f"{task}.bias"]
        head = torch.nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            head.weight.copy_(weight)
            head.bias.copy_(bias)
        heads[task] = head.eval()
    return heads


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
