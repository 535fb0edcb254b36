"""Resume: after each block, persist what is needed to continue, tied to a fingerprint of the run.

A checkpoint folder holds `state.json` (fingerprint, last finished block), one safetensors file of
calibrated parameters per finished block, and per process the feature streams entering the next block
(with the drift report and solve log so far). Only the newest streams are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

STATE_NAME = "state.json"


def tensor_digest(hasher: Any, name: str, tensor: Tensor) -> None:
    """Feed a cheap but discriminating summary of a tensor into `hasher`: name, shape, dtype, sums and
    a strided sample of values (hashing every byte of a multi-GB model would cost more than a block)."""
    t = tensor.detach()
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // 64)][:64].double().cpu()
    data = t.double()
    hasher.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    hasher.update(torch.stack([data.sum(), data.square().sum()]).cpu().numpy().tobytes() if t.numel() else b"")
    hasher.update(sample.numpy().tobytes())


def fingerprint(parts: Iterable[tuple[str, Any]]) -> str:
    """A hex digest of named parts: tensors (summarised), mappings of tensors, or JSON-able values."""
    hasher = hashlib.sha256()
    for name, value in parts:
        if isinstance(value, Tensor):
            tensor_digest(hasher, name, value)
        elif isinstance(value, Mapping) and all(isinstance(v, Tensor) for v in value.values()):
            for key in sorted(value):
                tensor_digest(hasher, f"{name}.{key}", value[key])
        else:
            hasher.update(f"{name}={json.dumps(value, sort_keys=True, default=str)}".encode())
    return hasher.hexdigest()


@dataclass
class ResumePoint:
    """What a checkpoint folder says: the last finished block (1-based over all stacks), the calibrated
    parameters of every finished block, and this process's streams entering the next block."""

    finished_blocks: int
    parameters: dict[str, Tensor]
    streams: dict[str, Any]


class CheckpointFolder:
    """Read and write one run's checkpoint folder."""

    def __init__(self, path: str | os.PathLike, digest: str, rank: int, is_main: bool, device: torch.device) -> None:
        self.path, self.digest, self.rank, self.is_main = os.fspath(path), digest, rank, is_main
        self.device = device

    def load(self) -> ResumePoint | None:
        """The resume point, None for a fresh folder; refuses a checkpoint of a different run."""
        state_path = os.path.join(self.path, STATE_NAME)
        if not os.path.isfile(state_path):
            return None
        with open(state_path, encoding="utf-8") as handle:
            state = json.load(handle)
        if state.get("fingerprint") != self.digest:
            raise ValueError(
                f"`checkpoint_dir` {self.path!r} holds a checkpoint of a different run (other models, data, "
                "config or number of processes); use another folder or delete it to start over."
            )
        finished = int(state["finished_blocks"])
        parameters: dict[str, Tensor] = {}
        for index in range(1, finished + 1):
            parameters.update(load_file(os.path.join(self.path, f"block-{index:05d}.safetensors")))
        streams = torch.load(os.path.join(self.path, f"streams-rank{self.rank}.pt"), map_location=self.device, weights_only=False)
        if streams.get("finished_blocks") != finished:
            raise ValueError(f"`checkpoint_dir` {self.path!r} is incomplete (streams of another block); delete it.")
        return ResumePoint(finished, parameters, streams)

    def save(self, finished_blocks: int, parameters: dict[str, Tensor], streams: dict[str, Any], barrier: Any) -> None:
        """Persist one more finished block: its parameters (main process), every process's streams,
        then the state marker (main process, after all processes wrote their streams)."""
        os.makedirs(self.path, exist_ok=True)
        if self.is_main:
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in parameters.items()}
            _atomic(os.path.join(self.path, f"block-{finished_blocks:05d}.safetensors"), lambda p: save_file(cpu, p))
        streams = {**streams, "finished_blocks": finished_blocks}
        _atomic(os.path.join(self.path, f"streams-rank{self.rank}.pt"), lambda p: torch.save(streams, p))
        barrier()
        if self.is_main:
            state = {"fingerprint": self.digest, "finished_blocks": finished_blocks}
            _atomic(os.path.join(self.path, STATE_NAME), lambda p: _write_json(state, p))
        barrier()


def _write_json(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def _atomic(path: str, write: Any) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)
