"""`restore_on_failure`: a failed calibration puts the caller's model back exactly as it was, from a
snapshot kept in host memory or in temporary safetensors files."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .config import RESTORE_SNAPSHOTS
from .interrupts import interrupts_deferred

#: a disk snapshot is written in files of about this size, so that a model on an accelerator passes
#: through host memory one file at a time
SNAPSHOT_FILE_BYTES = 256 * 2**20
#: dtypes a safetensors file holds, by their names in its header (anything else, e.g. a complex
#: buffer, stays in host memory)
_SAFETENSORS_NAMES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_SAFETENSORS_DTYPES = set(_SAFETENSORS_NAMES.values())


@contextlib.contextmanager
def restore_on_failure(
    model: nn.Module, parameter_names: Iterable[str], parameters: Any = None, snapshot: str = "memory"
) -> Iterator[None]:
    """If the body raises, put `model` back exactly as it was: every parameter and buffer, also those
    outside the blocks, as the same tensor objects in the same modules, with their values, devices and
    dtypes (a copy of each is kept while the body runs), whatever the body did — e.g. a move to
    the meta device, which replaces the tensor objects. Tensors accelerate had offloaded (on the meta
    device before the body) keep their hooks' placement; of those, the named parameters' values are
    restored through `parameters` (a `ModelParameters`), which reaches the offloaded copy.

    `snapshot` says where the copy is kept: "memory" (a CPU copy in host RAM; fastest) or "disk"
    (safetensors files in a new temporary folder under `tempfile.gettempdir()`, i.e. `TMPDIR`,
    each memory-mapped from the moment it is written and read through that mapping only to restore,
    so a temp-folder cleaner deleting them during a long run takes nothing away). The folder is
    removed on exit, on success and on failure alike.

    The restore runs with SIGINT deferred (`interrupts_deferred`): a second Ctrl-C while the model is
    being put back waits until it is back, then raises KeyboardInterrupt.

    With "memory", a named parameter on the CPU that shares its memory with no other tensor of the
    model is not copied into the snapshot: the snapshot keeps its memory and the parameter goes on
    in a private copy (the same copying; the Parameter object stays). The body's writes then never
    land in the pages of a memory-mapped checkpoint (`from_pretrained` maps safetensors files): each
    such page the forwards have read costs a copy-on-write fault (measured: 21 ms to write a 9.4 MB
    weight there, 0.7 ms into private memory). A failure hands the original memory back."""
    if snapshot not in RESTORE_SNAPSHOTS:
        raise ValueError(f"`snapshot` must be one of {RESTORE_SNAPSHOTS}, got {snapshot!r}.")
    if parameters is None:
        from .parameters import ModelParameters

        parameters = ModelParameters(model)
    # (module, "_parameters" / "_buffers", attribute) → the tensor object there now
    slots = [
        (module, kind, attr, tensor)
        for module in model.modules()
        for kind in ("_parameters", "_buffers")
        for attr, tensor in getattr(module, kind).items()
        if tensor is not None and not tensor.is_meta
    ]
    unique = {id(t): t for _, _, _, t in slots}  # tied weights: one tensor object in several slots
    parameter_names = list(parameter_names)
    placement = {name: t.device for name, t in _named_tensors(model)}
    offloaded = [name for name in parameter_names if placement.get(name) == torch.device("meta")]
    store = _DiskSnapshot() if snapshot == "disk" else _MemorySnapshot()
    handed_over = set() if snapshot == "disk" else _handover_candidates(model, parameter_names, unique.values())
    try:
        layout = {}  # id(tensor) → (device, dtype)
        for index, (ident, tensor) in enumerate(unique.items()):
            layout[ident] = (tensor.device, tensor.dtype)
            if ident in handed_over:  # the snapshot keeps this memory; the parameter goes on in a copy
                original = tensor.detach()
                assert isinstance(store, _MemorySnapshot)  # only a memory snapshot takes memory over
                store.keep(f"tensor.{index}", original)
                tensor.data = original.clone()
            else:
                store.add(f"tensor.{index}", tensor)
        for name in offloaded:
            store.add(f"offloaded.{name}", parameters.read(name))
        store.finish()
        try:
            yield
        except BaseException:
            with interrupts_deferred(), torch.no_grad():
                for module, kind, attr, tensor in slots:
                    getattr(module, kind)[attr] = tensor
                for index, (ident, tensor) in enumerate(unique.items()):
                    device, dtype = layout[ident]
                    value = store.read(f"tensor.{index}")
                    if ident in handed_over:
                        tensor.data = value  # its original memory back
                    elif (
                        tensor.is_meta
                        or tensor.device != device
                        or tensor.dtype != dtype
                        or tensor.shape != value.shape
                    ):
                        tensor.data = value.to(device=device, dtype=dtype)
                    else:
                        tensor.copy_(value)
                for name in offloaded:
                    parameters.write(name, store.read(f"offloaded.{name}"))
            raise
    finally:
        store.close()


def _handover_candidates(model: nn.Module, parameter_names: list[str], tensors: Iterable[Tensor]) -> set[int]:
    """ids of the named parameters whose memory a memory snapshot may keep instead of a copy: on the
    CPU, and sharing no memory with another tensor of the model (a view, or a parameter packed into
    one buffer with others, would keep seeing the memory the snapshot holds)."""
    owners: dict[int, int] = {}  # storage address → how many distinct tensors use it
    for tensor in tensors:
        address = tensor.untyped_storage().data_ptr()
        owners[address] = owners.get(address, 0) + 1
    named = {}
    for name in parameter_names:
        try:
            named[name] = model.get_parameter(name)
        except AttributeError:
            continue
    return {
        id(p) for p in named.values()
        if p.device.type == "cpu" and not p.is_meta and owners.get(p.untyped_storage().data_ptr()) == 1
    }


class _MemorySnapshot:
    """Copies of tensors in host memory (or, for `keep`, the tensors themselves)."""

    def __init__(self) -> None:
        self._values: dict[str, Tensor] = {}

    def add(self, key: str, tensor: Tensor) -> None:
        self._values[key] = tensor.detach().to("cpu", copy=True)

    def keep(self, key: str, tensor: Tensor) -> None:
        """Hold `tensor` itself: its owner no longer writes to its memory."""
        self._values[key] = tensor

    def finish(self) -> None:
        pass

    def read(self, key: str) -> Tensor:
        return self._values[key]

    def close(self) -> None:
        self._values.clear()


class _DiskSnapshot:
    """Copies of tensors in safetensors files of a new temporary folder (removed by `close`). Files are
    written about `SNAPSHOT_FILE_BYTES` at a time: CPU tensors are written from their own memory, others
    copied to the host one file's worth at a time.

    Each file is memory-mapped as soon as it is written, and `read` reads through that mapping, never
    by name: a file deleted from the folder meanwhile (a temp-folder cleaner; the folder itself
    removed) stays readable as long as it is mapped (POSIX keeps an unlinked file's data while it is
    open; Windows refuses to delete it). Keeping the files visible, rather than unlinked at once,
    leaves the disk space they take where a user looking for it finds it."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="hf_featcal-restore-")
        self._files: dict[str, str] = {}  # key → file
        self._maps: list[mmap.mmap] = []
        self._entries: dict[str, tuple[mmap.mmap, torch.dtype, list[int], int, int]] = {}  # key → where it lies
        self._in_memory = _MemorySnapshot()  # dtypes safetensors does not store
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._pending_storages: set[tuple[int, int]] = set()

    def add(self, key: str, tensor: Tensor) -> None:
        tensor = tensor.detach()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            self._in_memory.add(key, tensor)
            return
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or storage in self._pending_storages:
            # a host copy of its own (safetensors refuses tensors sharing memory in one file)
            tensor = tensor.to("cpu").clone(memory_format=torch.contiguous_format)
        else:
            self._pending_storages.add(storage)
        self._pending[key] = tensor
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= SNAPSHOT_FILE_BYTES:
            self._flush()

    def finish(self) -> None:
        self._flush()

    def _flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        if not self._pending:
            return
        path = os.path.join(self.folder, f"snapshot-{len(set(self._files.values())):05d}.safetensors")
        try:
            save_file(self._pending, path)
            self._map(path)
        except (OSError, SafetensorError, ValueError) as err:
            raise OSError(
                f"FeatCalConfig.restore_snapshot='disk': cannot write the restore snapshot in {self.folder!r} "
                f"({err}); free space there, set TMPDIR to a larger folder, or use restore_snapshot='memory'."
            ) from err
        self._files.update(dict.fromkeys(self._pending, path))
        self._pending, self._pending_bytes, self._pending_storages = {}, 0, set()

    def _map(self, path: str) -> None:
        """Map the file just written and note where each tensor lies in it (the safetensors layout: an
        8-byte little-endian header length, the JSON header, then the data; safetensors itself only
        reads files by name)."""
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # holds the file on its own
        self._maps.append(mapped)
        length = int.from_bytes(mapped[:8], "little")
        header = json.loads(mapped[8 : 8 + length])
        for key, entry in header.items():
            if key != "__metadata__":
                start, stop = entry["data_offsets"]
                self._entries[key] = (mapped, _SAFETENSORS_NAMES[entry["dtype"]], entry["shape"], 8 + length + start,
                                      stop - start)

    def read(self, key: str) -> Tensor:
        if key not in self._entries:
            return self._in_memory.read(key)
        mapped, dtype, shape, offset, size = self._entries[key]
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # the mapping is read-only; the copy below is what is used
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mapped, dtype=dtype, count=size // dtype.itemsize, offset=offset)
        return view.reshape(shape).clone()

    def close(self) -> None:
        self._pending.clear()
        self._in_memory.close()
        self._entries.clear()
        for mapped in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                mapped.close()
        self._maps.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
