"""`TaskModules`: the per-task representation corrections of a post-merging step (Surgery, ProbSurgery),
applied to a merged model given the task, saved beside it and loaded back.

The merged model is never changed: `for_task(model, task)` installs the task's correction as a forward
hook on the module whose output is the representation (`representation.RepresentationPoint`) and
removes it when the block ends, also after an exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..experts import module_device
from .corrections import CORRECTIONS
from .representation import (
    RepresentationPoint,
    check_point_module,
    replace_representation,
    representation_point,
)

#: The files `save_pretrained` writes (the manifest of a model save that includes them lists them).
WEIGHTS_NAME = "post_merging_modules.safetensors"
CONFIG_NAME = "post_merging_config.json"
_FORMAT = 1


def task_seed(seed: int, task: str) -> int:
    """The seed of one task's module (init, batch order, noise): from `seed` and the task's name only,
    so a task's module does not depend on which other tasks are trained or in which order."""
    return (seed * 1_000_003 + zlib.crc32(task.encode("utf-8"))) % 2**63


class TaskModules(nn.Module):
    """One correction per task (or one `shared` by every task) of a post-merging `method`
    ("surgery" or "prob_surgery"), acting on the representation at `point`.

    Args:
        method: "surgery" (`SurgeryModule`) or "prob_surgery" (`ProbSurgeryModule`).
        tasks: the task names, in order.
        point: where the representation is (`representation_point(merged)`).
        shared: one module for every task (no task needed at inference).
        seed: each module is initialised under `task_seed(seed, task)` ("" for the shared one); the
            global random state is left as it was.
        hyper_parameters: the module's constructor arguments ("rank" for surgery; "hidden",
            "kl_weight" for prob_surgery); missing ones take the module's defaults.
        training: how the modules were trained (steps, lr, ...), recorded in the saved config only.
    """

    def __init__(
        self,
        method: str,
        tasks: Sequence[str],
        point: RepresentationPoint,
        *,
        shared: bool = False,
        seed: int = 0,
        hyper_parameters: Mapping[str, Any] | None = None,
        training: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if method not in CORRECTIONS:
            raise ValueError(f"`method` must be one of {sorted(CORRECTIONS)}, got {method!r}.")
        tasks = list(tasks)
        if not tasks or not all(isinstance(t, str) and t for t in tasks) or len(set(tasks)) != len(tasks):
            raise ValueError(f"`tasks` must be distinct non-empty task names, got {tasks!r}.")
        cls, accepted = CORRECTIONS[method]
        hyper_parameters = dict(hyper_parameters or {})
        unknown = sorted(set(hyper_parameters) - set(accepted))
        if unknown:
            raise ValueError(f"`hyper_parameters` of {method!r} take {list(accepted)}, got unknown {unknown}.")
        self.method, self.tasks, self.point, self.shared = method, tasks, point, bool(shared)
        self.seed, self.hyper_parameters = seed, hyper_parameters
        self.training_settings = dict(training or {})
        modules = []
        for name in ([""] if self.shared else tasks):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(task_seed(seed, name))
                modules.append(cls(point.dim, **hyper_parameters))
        self.corrections = nn.ModuleList(modules)

    # ------------------------------------------------------------------ which module
    @property
    def needs_task(self) -> bool:
        """Whether inference needs the task (False for a shared module)."""
        return not self.shared

    def module_for(self, task: str | None) -> nn.Module:
        """The correction of `task` (the shared one, whatever `task` is, when shared)."""
        if self.shared:
            return self.corrections[0]
        if task not in self.tasks:
            raise ValueError(f"`task` must be one of {self.tasks} (these modules are per task), got {task!r}.")
        return self.corrections[self.tasks.index(task)]

    def num_parameters(self) -> int:
        """Parameters these modules add to the merged model (all tasks together)."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ applying
    def forward(self, z: Tensor, task: str | None = None) -> Tensor:
        """The corrected representation of `task` (inference: ProbSurgery subtracts μ only), computed
        in the modules' dtype and device and returned in `z`'s."""
        module = self.module_for(task)
        weight = next(module.parameters())
        return module(z.to(device=weight.device, dtype=weight.dtype)).to(device=z.device, dtype=z.dtype)

    def apply(self, z: Any, task: str | None = None) -> Any:
        """Same as calling the modules: the corrected representation of `task`. Given a function instead
        of a tensor, `nn.Module.apply` (the function applied to every submodule), which torch and
        transformers call on a model's children."""
        if not isinstance(z, Tensor) and callable(z):
            return super().apply(z)
        return self(z, task)

    @contextlib.contextmanager
    def for_task(self, model: nn.Module, task: str | None = None) -> Iterator[nn.Module]:
        """While active, `model`'s representation (the output of `point.module`) is replaced by its
        correction for `task`; the hook is removed on exit, also after an exception. Yields `model`."""
        module = self.module_for(task)
        target = check_point_module(model, self.point)
        here = representation_point(model)
        if (here.module, here.selection, here.dim) != (self.point.module, self.point.selection, self.point.dim):
            raise ValueError(
                f"`model` ({type(model).__name__}) reads its representation at {here.module!r} ({here.dim} "
                f"features), these modules were trained at {self.point.module!r} ({self.point.dim} features)."
            )
        device = module_device(target) if any(True for _ in target.parameters()) else module_device(model)
        weight = next(module.parameters())
        if weight.device != device:
            import copy

            module = copy.deepcopy(module).to(device)
            weight = next(module.parameters())

        def correct(z: Tensor) -> Tensor:
            return module(z.to(weight.dtype)).to(z.dtype)

        def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
            return replace_representation(output, self.point, correct)

        handle = target.register_forward_hook(hook)
        try:
            yield model
        finally:
            handle.remove()

    # ------------------------------------------------------------------ saving
    def config_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "library": "hf_featcal",
            "method": self.method,
            "tasks": self.tasks,
            "shared": self.shared,
            "needs_task": self.needs_task,
            "seed": self.seed,
            "hyper_parameters": self.hyper_parameters,
            "training": self.training_settings,
            "num_parameters": self.num_parameters(),
            "representation": self.point.to_dict(),
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> list[str]:
        """Write `post_merging_modules.safetensors` and `post_merging_config.json` into `save_directory`
        (created if needed): each is written to a temporary file there and renamed into place, so a
        failure leaves no partial file. Returns the two paths."""
        from safetensors.torch import save_file

        folder = os.fspath(save_directory)
        os.makedirs(folder, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        written = []
        temporaries = []
        try:
            for name, write in (
                (WEIGHTS_NAME, lambda path: save_file(state, path, metadata={"format": "pt"})),
                (CONFIG_NAME, lambda path: _write_json(path, self.config_dict())),
            ):
                handle, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
                os.close(handle)
                temporaries.append(temporary)
                write(temporary)
                written.append((temporary, os.path.join(folder, name)))
            for temporary, path in written:
                os.replace(temporary, path)
        finally:
            for temporary in temporaries:
                if os.path.exists(temporary):
                    os.remove(temporary)
        return [path for _, path in written]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, device: str | torch.device | None = None) -> TaskModules:
        """The modules `save_pretrained` wrote into `directory` (on the CPU, or `device`)."""
        from safetensors.torch import load_file

        folder = os.fspath(directory)
        config_path, weights_path = os.path.join(folder, CONFIG_NAME), os.path.join(folder, WEIGHTS_NAME)
        for path in (config_path, weights_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{folder!r} holds no post-merging modules: {os.path.basename(path)} is missing."
                )
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
        if not isinstance(config, dict) or config.get("format") != _FORMAT or config.get("method") not in CORRECTIONS:
            raise ValueError(f"{config_path!r} is not a post-merging config this version reads (format {_FORMAT}).")
        modules = cls(
            config["method"], config["tasks"], RepresentationPoint.from_dict(config["representation"]),
            shared=config["shared"], seed=config.get("seed", 0), hyper_parameters=config["hyper_parameters"],
            training=config.get("training"),
        )
        modules.load_state_dict(load_file(weights_path), strict=True)
        return modules.to(device) if device is not None else modules


def _write_json(path: str, values: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")
