"""The state every stage shares, below every stage: no stage imports the calibrator facade."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

from .._kernels.activations import lean_activations
from .._kernels.finite import all_finite
from .._kernels.gemm import onednn_linears
from .._kernels.memory import release_freed_memory
from .._kernels.reuse import ReusableMemory, linears_into
from ..architectures import LayerMap
from ..config import FeatCalConfig
from ..experts import module_device
from ..parameters import ModelParameters
from .streams import StreamBatch

#: Kept under the facade's module name, so logging set up for `hf_featcal.calibrator` still applies.
LOGGER = logging.getLogger("hf_featcal.calibrator")


#: hf_featcal's folder: a warning points at the first frame outside it
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning its caller issues point at the first frame outside
    hf_featcal, the user's line that called into the library, however many of the library's frames
    lie between (Python 3.12's `skip_file_prefixes`; this package supports older versions)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


class FeatCalWarning(UserWarning):
    """A result to look at: a module whose solution is set by the ridge rather than by the data, or a
    task whose head reads features that calibration moved away from its expert's."""


class FeatCalError(ValueError):
    """Calibration cannot go on (non-finite features or solutions); the model is left as it was."""


def check_finite(value: Tensor, what: str) -> None:
    if not all_finite(value):
        raise FeatCalError(f"non-finite values in the {what}; the model was left unchanged.")


@dataclass
class RunContext:
    """The merged model and what the stages of one run share: where tensors go, the accumulation
    dtype, the process group (an accelerate state), the stage timings and the solve log."""

    model: nn.Module
    layer_map: LayerMap
    config: FeatCalConfig
    parameters: ModelParameters
    process: Any  # accelerate's PartialState / AcceleratorState
    device: torch.device
    compute_dtype: torch.dtype
    #: seconds per stage; `profile` synchronises the device around each stage (exact GPU timings)
    timings: dict[str, float] = field(default_factory=dict)
    profile: bool = False
    solve_log: list[dict[str, Any]] = field(default_factory=list)
    #: task → its weight ω_i in the joint objective (`FeatCalConfig.normalised_task_weights`); a task
    #: not in it weighs 1
    task_weights: dict[str, float] = field(default_factory=dict)
    #: one entry per guarded block (`pipeline/guard.py`): block, chosen γ, grid, held-out drift per γ
    guard_log: list[dict[str, Any]] = field(default_factory=list)
    logger: logging.Logger = LOGGER
    _workspaces: dict[tuple, Tensor] = field(default_factory=dict, repr=False)
    #: the block forwards' reused CPU memory while `workspaces()` is open (None outside it)
    _memory: ReusableMemory | None = field(default=None, repr=False)

    @property
    def tower(self) -> nn.Module:
        return self.layer_map.tower(self.model)

    def block(self, stack_index: int, block_index: int) -> nn.Module:
        return self.layer_map.stacks(self.tower)[stack_index].blocks[block_index]

    def where(self, stack_index: int, block_index: int) -> str:
        """How messages name a block: "block 1 of vision_encoder"."""
        return f"block {block_index} of {self.layer_map.stacks(self.tower)[stack_index].name}"

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the body to `timings[stage]` (device-synchronised when profiling)."""
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.profile and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start

    def park(self, state: StreamBatch) -> StreamBatch:
        """Where a stream batch waits between blocks (`FeatCalConfig.stream_placement`)."""
        placement = self.config.stream_placement
        if placement == "accelerator":
            return state.to(self.device)
        state = state.to("cpu")
        return state.pin_memory() if placement == "pinned_cpu" and torch.cuda.is_available() else state

    def task_done(self) -> None:
        """Between two tasks' passes over a block: the CPU memory freed during the pass is handed back to
        the system (`_kernels.memory.release_freed_memory`), so that the free holes the pass left among
        the streams kept for the next block do not stay resident."""
        with self.timed("handing back freed memory"):
            release_freed_memory()

    def fetch(self, state: StreamBatch) -> StreamBatch:
        """A parked stream batch on the compute device."""
        return state.to(self.device, non_blocking=self.config.stream_placement == "pinned_cpu")

    @property
    def forward_dtype(self) -> torch.dtype | None:
        """Fast mode's dtype of the block forwards and the statistics' products (None: exact)."""
        name = self.config.forward_dtype
        return None if name is None else getattr(torch, name)

    def precision(self) -> contextlib.AbstractContextManager:
        """Fast mode's `torch.autocast` (a no-op context in exact mode). Held around a loop over
        batches, it keeps autocast's cache of the weights' low-precision copies for the whole loop
        (the cache is dropped when the outermost autocast context exits)."""
        if self.forward_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.forward_dtype)

    def forward(self, block: nn.Module, index: int, state: StreamBatch) -> StreamBatch:
        """One block on a stream batch on the compute device; in fast mode under `torch.autocast`.
        The block's activations run allocation-lean (`hf_featcal._kernels.activations`, bit-identical), and
        its float32 Linears on the CPU by the faster of MKL and oneDNN for this CPU
        (`hf_featcal._kernels.gemm`; the two differ by rounding only). Within `workspaces()`, their
        outputs on the CPU reuse memory earlier forwards left (`hf_featcal._kernels.reuse`, bit-identical)."""
        memory = self._memory
        with self.precision(), lean_activations(block, memory), onednn_linears(block), linears_into(block, memory):
            return self.layer_map.run_block(block, index, state)

    def run_block(self, block: nn.Module, index: int, parked: StreamBatch) -> StreamBatch:
        """A parked batch through `block`, parked again."""
        return self.park(self.forward(block, index, self.fetch(parked)))

    def workspace(self, like: Tensor) -> Tensor:
        """A scratch matrix of `like`'s shape, dtype and device, kept until the run ends
        (`workspaces()`) and handed out again for every matrix of that shape; its content is whatever
        its last user left. The solve stage factors in it: a fresh matrix of the fc2 Gram's size per
        solve costs more in page faults than the factorisation's own copy."""
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return self._workspaces[key]

    @contextlib.contextmanager
    def workspaces(self) -> Iterator[None]:
        """The lifetime of `workspace()`'s matrices and of the memory the block forwards reuse
        (`forward`): they are dropped on exit, also on error."""
        self._memory = ReusableMemory()
        try:
            yield
        finally:
            self._workspaces.clear()
            self._memory = None

    def reduce(self, tensors: list[Tensor]) -> list[Tensor]:
        """Sum tensors across processes (identity on one process)."""
        if self.process.num_processes == 1:
            return tensors
        from accelerate.utils import reduce

        return reduce(tensors, reduction="sum")

    def input_device(self, tower: nn.Module) -> torch.device:
        """Where the merged model's inputs go: its own device, or for a dispatched model the compute
        device (accelerate's hooks move them on)."""
        return self.device if self.parameters.dispatched else module_device(tower)
