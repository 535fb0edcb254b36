"""Resume: after each block, persist what is needed to continue, tied to a fingerprint of the run.

A checkpoint folder holds `state.json` (format, fingerprint, last finished block, the SHA-256 of
every block file), one safetensors file of calibrated parameters per finished block, and per process
one safetensors file with the feature streams entering the next block; the streams' structure (and
the drift report and solve log so far) is JSON in that file's metadata, with a SHA-256 of the
structure and every stream tensor. Nothing is ever unpickled: a tampered folder can at worst be
refused, and a file whose bytes changed since its commit (bit rot, an edited shared folder) is
refused before anything is written to the model.

Each block is committed atomically: its parameter and stream files are written under names of
their own (via temporary names), then `state.json` is replaced in one `os.replace`, which is the
commit; the previous block's streams are deleted only after it. An interruption at any point leaves
either the old or the new state, both complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from ._kernels.finite import all_finite
from .pipeline.streams import StreamBatch

STATE_NAME = "state.json"
FORMAT = 3  # 1: pickled streams (streams-rank<r>.pt), never read; 2: no digests of the files, not resumed

try:  # a dependency of `datasets`; ~10x faster than the hashlib fallback
    import xxhash

    def _new_hasher() -> Any:
        return xxhash.xxh3_128()
except ImportError:  # pragma: no cover

    def _new_hasher() -> Any:
        return hashlib.blake2b(digest_size=16)


def tensor_digest(hasher: Any, name: str, tensor: Tensor) -> None:
    """Feed a tensor's name, shape, dtype and every byte of its contents into `hasher`."""
    t = tensor.detach()
    hasher.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
    if t.numel() == 0:
        return
    if t.is_meta:
        raise ValueError(f"cannot fingerprint {name!r}: it has no values (meta device)")
    data = t.reshape(-1)
    if data.device.type != "cpu":
        data = data.cpu()
    hasher.update(data.contiguous().view(torch.uint8).numpy().data)  # the array's buffer, not a copy


def file_digest(path: str, chunk: int = 1 << 24, hasher: Any = None) -> str:
    """A content hash of a file (read in chunks, never held whole); xxh3 unless `hasher` is given."""
    hasher = _new_hasher() if hasher is None else hasher
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            hasher.update(block)
    return hasher.hexdigest()


class DigestBuilder:
    """`fingerprint`'s digest built part by part (parts may be let go once added)."""

    def __init__(self) -> None:
        self._hasher = _new_hasher()

    def add_all(self, parts: Iterable[tuple[str, Any]]) -> None:
        """Named parts: tensors (hashed byte for byte), mappings of tensors, or JSON-able values."""
        for name, value in parts:
            if isinstance(value, Tensor):
                tensor_digest(self._hasher, name, value)
            elif isinstance(value, Mapping) and value and all(isinstance(v, Tensor) for v in value.values()):
                for key in sorted(value):
                    tensor_digest(self._hasher, f"{name}.{key}", value[key])
            else:
                self._hasher.update(f"{name}={json.dumps(value, sort_keys=True, default=str)}".encode())

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def fingerprint(parts: Iterable[tuple[str, Any]]) -> str:
    """A hex digest of named parts: tensors (hashed byte for byte), mappings of tensors, or JSON-able values."""
    builder = DigestBuilder()
    builder.add_all(parts)
    return builder.hexdigest()


@dataclass
class ResumePoint:
    """What a checkpoint folder says: the last finished block (1-based over all stacks) and this
    process's streams entering the next block. The finished blocks' parameters are not held here:
    their files were checked (headers only) and are read one block at a time by
    `CheckpointFolder.read_block`, so a resume never holds more than one block of them."""

    finished_blocks: int
    streams: dict[str, Any]


class CheckpointFolder:
    """Read and write one run's checkpoint folder."""

    def __init__(self, path: str | os.PathLike, digest: str, rank: int, is_main: bool, device: torch.device) -> None:
        self.path, self.digest, self.rank, self.is_main = os.fspath(path), digest, rank, is_main
        self.device = device
        self._block_sha256: dict[int, str] = {}  # finished block → SHA-256 of its file's bytes, as committed

    # ------------------------------------------------------------------ names
    def _block_file(self, finished: int) -> str:
        return os.path.join(self.path, f"block-{finished:05d}.safetensors")

    def _streams_file(self, finished: int) -> str:
        return os.path.join(self.path, f"streams-rank{self.rank}-block{finished:05d}.safetensors")

    def _damaged(self, what: str, err: Exception | str) -> ValueError:
        return ValueError(f"`checkpoint_dir` {self.path!r} is damaged ({what}: {err}); delete it to start over.")

    @contextlib.contextmanager
    def _writing(self, path: str) -> Iterator[None]:
        """A failure of the disk while writing `path` (full, a file-size limit, read-only) told as what
        it is, naming the folder and the file, instead of a bare OSError / SafetensorError."""
        try:
            yield
        except (OSError, SafetensorError) as err:
            raise OSError(
                f"`checkpoint_dir` {self.path!r}: cannot write {os.path.basename(path)} ({_disk_error(err)}). "
                "Free space there or pass another folder; the blocks committed before stay resumable."
            ) from err

    # ------------------------------------------------------------------ read
    def load(self, parameter_shapes: Mapping[str, tuple[int, ...]]) -> ResumePoint | None:
        """The resume point, None for a fresh folder; refuses a checkpoint of a different run, of an
        older format, or a damaged one (naming the file) — including a block file holding a name
        that is not in `parameter_shapes` (the model's parameters) or a tensor of another shape.
        Only headers of the block files are read here; nothing is loaded for the caller to write
        until every block file has passed."""
        state_path = os.path.join(self.path, STATE_NAME)
        if not os.path.isfile(state_path):
            return None
        try:
            with open(state_path, encoding="utf-8") as handle:
                state = json.load(handle)
            if not isinstance(state, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            raise self._damaged(STATE_NAME, err) from None
        if state.get("format") != FORMAT:
            raise ValueError(
                f"`checkpoint_dir` {self.path!r} was written by an older hf_featcal (pickled streams, which are "
                "never loaded, or block files without digests to verify them); delete it to start over."
            )
        if state.get("fingerprint") != self.digest:
            raise ValueError(
                f"`checkpoint_dir` {self.path!r} holds a checkpoint of a different run (other models, data, "
                "config or number of processes; a model's weight files, or a LoRA adapter's adapter_config.json, "
                "changed since); use another folder or delete it to start over."
            )
        finished = state.get("finished_blocks")
        if isinstance(finished, bool) or not isinstance(finished, int) or finished < 1:
            raise self._damaged(STATE_NAME, f"finished_blocks is {finished!r}")
        recorded = state.get("block_sha256")
        if not isinstance(recorded, dict):
            raise self._damaged(STATE_NAME, f"block_sha256 is {recorded!r}")
        for index in range(1, finished + 1):
            self._check_block(index, parameter_shapes, recorded)
        return ResumePoint(finished, self._load_streams(finished))

    def _check_block(self, index: int, parameter_shapes: Mapping[str, tuple[int, ...]],
                     recorded: Mapping[str, Any]) -> None:
        """Refuse block file `index` unless it opens, every tensor in it names a parameter of the
        model, with the parameter's shape (its header, which tells what is wrong most clearly), and
        its bytes are those committed (the SHA-256 `recorded` in `state.json`)."""
        path = self._block_file(index)
        name = os.path.basename(path)
        try:
            with safe_open(path, framework="pt") as handle:
                shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            actual = file_digest(path, hasher=hashlib.sha256())
        except (OSError, SafetensorError) as err:
            raise self._damaged(name, err) from None
        for key, shape in shapes.items():
            if key not in parameter_shapes:
                raise self._damaged(name, f"{key!r} is not a parameter of the model")
            if shape != tuple(parameter_shapes[key]):
                raise self._damaged(
                    name, f"{key!r} has shape {list(shape)}, the model's parameter {list(parameter_shapes[key])}"
                )
        if recorded.get(name) != actual:
            raise self._damaged(
                name,
                f"its contents are not those committed with block {index} (SHA-256 {actual}, recorded "
                f"{recorded.get(name)})",
            )
        self._block_sha256[index] = actual

    def read_block(self, index: int) -> dict[str, Tensor]:
        """The calibrated parameters of finished block `index` (1-based), checked by `load` before;
        refused (naming the file) if any value is not finite. The tensors are views of the
        memory-mapped file, which stays mapped exactly as long as the caller holds any of them: drop
        them before reading the next block."""
        path = self._block_file(index)
        name = os.path.basename(path)
        try:
            with safe_open(path, framework="pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except (OSError, SafetensorError) as err:  # e.g. the file went away after `load`
            raise self._damaged(name, err) from None
        for key, value in tensors.items():
            if not all_finite(value):
                raise self._damaged(name, f"{key!r} holds NaN or Inf values")
        return tensors

    def _load_streams(self, finished: int) -> dict[str, Any]:
        path = self._streams_file(finished)
        name = os.path.basename(path)
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            if metadata["sha256"] != _streams_digest(metadata["structure"], tensors):
                raise ValueError("its contents are not those committed (SHA-256 of the streams differs)")
            structure = json.loads(metadata["structure"])
            return _decode(structure, tensors, {}, self.device)
        except (OSError, SafetensorError, KeyError, ValueError, TypeError) as err:
            raise self._damaged(name, f"{type(err).__name__}: {err}") from None

    # ------------------------------------------------------------------ write
    def save(self, finished_blocks: int, parameters: dict[str, Tensor], streams: dict[str, Any], barrier: Any) -> None:
        """Persist one more finished block: its parameters (main process) and every process's streams
        under new names, then the commit (`state.json` replaced, main process, after every process
        wrote), then the previous block's streams are removed."""
        os.makedirs(self.path, exist_ok=True)
        if self.is_main:
            cpu = _unshared({k: v.detach().to("cpu").contiguous() for k, v in parameters.items()})
            block = self._block_file(finished_blocks)

            def write_block(path: str) -> None:
                save_file(cpu, path)
                self._block_sha256[finished_blocks] = file_digest(path, hasher=hashlib.sha256())

            with self._writing(block):
                _atomic(block, write_block)
        tensors: dict[str, Tensor] = {}
        structure = json.dumps(_encode(streams, tensors, {}, {}))
        tensors = _unshared(tensors)
        metadata = {"structure": structure, "finished_blocks": str(finished_blocks),
                    "sha256": _streams_digest(structure, tensors)}
        with self._writing(self._streams_file(finished_blocks)):
            _atomic(self._streams_file(finished_blocks), lambda p: save_file(tensors, p, metadata=metadata))
        barrier()
        if self.is_main:
            committed = {
                os.path.basename(self._block_file(i)): self._block_sha256[i] for i in range(1, finished_blocks + 1)
            }
            state = {"format": FORMAT, "fingerprint": self.digest, "finished_blocks": finished_blocks,
                     "block_sha256": committed}
            with self._writing(STATE_NAME):
                commit_state(os.path.join(self.path, STATE_NAME), state)
        barrier()
        own = f"streams-rank{self.rank}-block"
        keep = os.path.basename(self._streams_file(finished_blocks))
        for name in os.listdir(self.path):
            if name.startswith(own) and name != keep:
                os.remove(os.path.join(self.path, name))


def _streams_digest(structure: str, tensors: Mapping[str, Tensor]) -> str:
    """SHA-256 of a streams file's structure and every tensor in it (names, shapes, dtypes, bytes)."""
    hasher = hashlib.sha256(structure.encode())
    for key in sorted(tensors):
        tensor_digest(hasher, key, tensors[key])
    return hasher.hexdigest()


def _disk_error(err: Exception) -> str:
    """What went wrong in plain words: an OSError's text, or the OS message safetensors wraps
    (`Error while serializing: I/O error: No space left on device (os error 28)`)."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}, errno {err.errno}"
    found = re.search(r"I/O error: (.+) \(os error (\d+)\)", str(err))
    return f"{found.group(1)}, errno {found.group(2)}" if found else str(err)


def commit_state(path: str, state: dict) -> None:
    """Replace `state.json` in one atomic step (the commit of a block)."""
    _atomic(path, lambda p: _write_json(state, p))


def _write_json(data: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _atomic(path: str, write: Any) -> None:
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _unshared(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors with every one sharing storage with an earlier one copied (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out = {}
    for key, value in tensors.items():
        value = value.contiguous()
        pointer = value.untyped_storage().data_ptr() if value.numel() else 0
        if pointer and pointer in seen:
            value = value.clone()
        seen.add(pointer)
        out[key] = value
    return out


# ---------------------------------------------------------------------------- streams ↔ JSON + tensors
# Stream batches, tuples, lists, str-keyed dicts, tensors and JSON scalars. Object identity is kept
# (the calibrator relies on a merged-as-given batch *being* the student's batch until a block is solved).
def _encode(obj: Any, tensors: dict[str, Tensor], tensor_ids: dict[int, str], batch_ids: dict[int, int]) -> Any:
    if isinstance(obj, Tensor):
        key = tensor_ids.get(id(obj))
        if key is None:
            key = tensor_ids[id(obj)] = str(len(tensors))
            tensors[key] = obj.detach().to("cpu")
        return {"$tensor": key, "cpu": obj.device.type == "cpu"}
    if isinstance(obj, StreamBatch):
        if id(obj) in batch_ids:
            return {"$same_batch": batch_ids[id(obj)]}
        batch_ids[id(obj)] = len(batch_ids)
        fields = {f: getattr(obj, f) for f in ("hidden", "args", "kwargs", "weights", "extras")}
        return {"$batch": batch_ids[id(obj)],
                **{k: _encode(v, tensors, tensor_ids, batch_ids) for k, v in fields.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, tensors, tensor_ids, batch_ids) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, tensor_ids, batch_ids) for v in obj]
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"$dict": {k: _encode(v, tensors, tensor_ids, batch_ids) for k, v in obj.items()}}
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    raise TypeError(f"cannot checkpoint a stream value of type {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, Tensor], batches: dict[int, StreamBatch], device: torch.device) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, batches, device) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$tensor" in obj:
        tensor = tensors[obj["$tensor"]]
        return tensor if obj["cpu"] else tensor.to(device)
    if "$same_batch" in obj:
        return batches[obj["$same_batch"]]
    if "$batch" in obj:
        names = ("hidden", "args", "kwargs", "weights", "extras")
        fields = {k: _decode(obj[k], tensors, batches, device) for k in names}
        batch = batches[obj["$batch"]] = StreamBatch(**fields)
        return batch
    if "$tuple" in obj:
        return tuple(_decode(v, tensors, batches, device) for v in obj["$tuple"])
    if "$dict" in obj:
        return {k: _decode(v, tensors, batches, device) for k, v in obj["$dict"].items()}
    if "$dtype" in obj:
        dtype = getattr(torch, obj["$dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {obj['$dtype']!r}")
        return dtype
    raise ValueError(f"unknown entry {sorted(obj)}")
