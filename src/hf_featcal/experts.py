"""Where models come from: in-memory models, local folders or hub ids; and their blocks on the device."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._kernels.finite import all_finite
from .architectures import LayerMap
from .model_io import (
    AdapterExpert,
    LazyTensors,
    LoraAdapter,
    load_checkpoint,
    load_model,  # noqa: F401 - documented as importable from here (docs/api.md)
    resolve_checkpoint,
    tower_key_map,
)


def block_on_device(block: nn.Module, device: torch.device) -> nn.Module:
    """`block` itself when its parameters are already on `device`, else a copy moved there
    (the caller's model is never moved)."""
    params = list(block.parameters())
    if not params or all(p.device == device for p in params):
        return block
    clone = copy.deepcopy(block)
    return clone.to(device)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter not on the meta device (CPU when it has none): a
    meta parameter (offloaded, or not loaded yet) holds no data, so inputs cannot go there."""
    for param in module.parameters():
        if not param.is_meta:
            return param.device
    return torch.device("cpu")


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (float32 when it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


# ---------------------------------------------------------------------------- sources
class ModelSource:
    """Where one expert's (or the base's) parameters come from. The calibrator asks a source for its
    config, its tower's parameter shapes, one block at a time, and a tower to enter a stack with.
    `layer_map` (the merged model's, bound by `make_source`) says where the tower and its blocks are;
    `reference` is the merged model, whose blocks are the skeletons of a checkpoint's blocks."""

    argument: str
    config: Any
    name: str | None
    layer_map: LayerMap

    def tower_shapes(self, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def block(self, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        """Block `index` of stack `stack`, on `device`, in eval mode; never the caller's module moved."""
        raise NotImplementedError

    @contextlib.contextmanager
    def entry_tower(self, reference: nn.Module) -> Iterator[nn.Module]:
        """A tower whose input path (everything before the first block of each stack) is this model's."""
        raise NotImplementedError
        yield

    def modules_for_eval(self) -> list[nn.Module]:
        return []

    def digest(self, reference: nn.Module) -> Any:
        """Something that changes when the model's weights change (for resume fingerprints)."""
        raise NotImplementedError

    def check_finite(self, reference: nn.Module) -> None:
        """Refuse NaN/Inf in the weights the calibration will read, where that costs no extra read (a
        model in memory); a checkpoint's tensors are checked when they are read (`_finite`)."""

    def _finite(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """`value` (the tensor `key` of this model), refused with a ValueError naming the model and the
        tensor when it holds NaN/Inf — before anything computed from it is solved or written."""
        if not value.is_meta and not all_finite(value):
            where = f" ({self.name})" if self.name else ""
            raise ValueError(
                f"`{self.argument}`{where} has non-finite values (NaN/Inf) in {key!r}; refusing to calibrate with it."
            )
        return value


class InMemorySource(ModelSource):
    """A model object the caller handed over (or one loaded whole, for non-safetensors checkpoints)."""

    def __init__(self, model: nn.Module, argument: str, layer_map: LayerMap, name: str | None = None) -> None:
        from .architectures import model_config

        self.model, self.argument, self.config = model, argument, model_config(model)
        self.layer_map = layer_map
        self.name = name or getattr(self.config, "_name_or_path", None) or None

    def tower_shapes(self, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.layer_map.tower(self.model).state_dict().items()}

    def block(self, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        return block_on_device(self.layer_map.stacks(self.layer_map.tower(self.model))[stack].blocks[index], device)

    @contextlib.contextmanager
    def entry_tower(self, reference: nn.Module) -> Iterator[nn.Module]:
        yield self.layer_map.tower(self.model)

    def modules_for_eval(self) -> list[nn.Module]:
        return [self.model]

    def digest(self, reference: nn.Module) -> Any:
        return self.layer_map.tower(self.model).state_dict()

    def check_finite(self, reference: nn.Module) -> None:
        for key, value in self.layer_map.tower(self.model).state_dict().items():
            self._finite(key, value)


class CheckpointSource(ModelSource):
    """A checkpoint folder read lazily with `safetensors.safe_open`: only the tensors of the block in
    use are ever materialised. Blocks are built as copies of the merged model's block (the reference)
    with this checkpoint's tensors loaded into them."""

    def __init__(
        self, folder: str | None, argument: str, name: str, layer_map: LayerMap, config: Any = None,
        files: dict[str, str] | None = None, stored: dict[str, str] | None = None,
    ) -> None:
        """A transformers checkpoint `folder` (config and safetensors found there), or a library
        checkpoint given by its `config` and `files` (state-dict key → safetensors file)."""
        self.folder, self.argument, self.name, self.layer_map = folder, argument, name, layer_map
        if config is None:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            except Exception as err:
                raise ValueError(f"`{argument}`: cannot load a model config from {name!r}: {err}") from err
        self.config = config
        if files is None:  # the folder's tensors, named as `resolve_checkpoint` names them
            assert folder is not None
            checkpoint = resolve_checkpoint(folder, argument)
            files, stored = checkpoint.files, checkpoint.stored
        self._tensors = LazyTensors(files, argument, stored)
        self._key_map: dict[str, str] | None = None

    # -- keys
    def _keys(self, reference: nn.Module) -> dict[str, str]:
        """Tower-relative parameter name → checkpoint key (prefix as the checkpoint has it, ties resolved)."""
        if self._key_map is not None:
            return self._key_map
        tower = self.layer_map.tower(reference)
        names = list(tower.state_dict().keys())
        tied: dict[str, str] = {}
        for cls in type(reference).__mro__:
            tied.update(getattr(cls, "_tied_weights_keys", None) or {})
        optional = [name for name in names if _is_non_persistent(tower, name)]
        mapping, errors = tower_key_map(names, self._tensors.keys(), self.layer_map.checkpoint_prefixes, tied, optional)
        if mapping is None:
            raise ValueError(
                f"`{self.argument}` ({self.name}) lacks parameters of the merged model's tower ({'; '.join(errors)})."
            )
        self._key_map = mapping
        return mapping

    def _read(self, key: str) -> torch.Tensor:
        return self._tensors.read(key)

    def tower_shapes(self, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        return {name: self._tensors.shape(key) for name, key in self._keys(reference).items()}

    def digest(self, reference: nn.Module) -> Any:
        from .checkpointing import file_digest

        files = sorted(set(self._tensors.files.values()))
        return [(os.path.basename(f), file_digest(f)) for f in files]

    # -- blocks and entry
    def block(self, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        tower = self.layer_map.tower(reference)
        skeleton = self.layer_map.stacks(tower)[stack].blocks[index]
        prefix = _qualified_name(tower, skeleton)
        keys = self._keys(reference)
        if any(p.is_meta for p in skeleton.parameters()):  # an offloaded block of a dispatched merged model
            return self._block_into_copy(skeleton, prefix, keys).to(device).eval()
        # The checkpoint's tensors become the copy's own: safetensors hands out views of its memory map,
        # so nothing is read until a forward touches it, and the merged block's data is never copied
        # (deepcopy takes them from `memo`).
        memo: dict[int, Any] = {}
        with self._tensors:
            for name, tensor in list(skeleton.named_parameters()) + list(skeleton.named_buffers()):
                value = self._block_tensor(keys, prefix, name, tensor)
                if value is not None:
                    memo[id(tensor)] = (nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, nn.Parameter)
                                        else value)
        return copy.deepcopy(skeleton, memo).to(device).eval()

    def _block_tensor(self, keys: dict[str, str], prefix: str, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The checkpoint's value of the block tensor `name` in the tensor's dtype (None: a buffer the
        checkpoint does not store)."""
        key = keys.get(f"{prefix}.{name}")
        if key is None:
            if isinstance(tensor, nn.Parameter):
                raise ValueError(f"`{self.argument}` ({self.name}) has no tensor for {prefix}.{name}")
            return None
        value = self._finite(key, self._read(key))
        if value.shape != tensor.shape:
            raise ValueError(
                f"`{self.argument}` ({self.name}): {key} has shape {tuple(value.shape)}, the merged model's "
                f"{prefix}.{name} has {tuple(tensor.shape)}"
            )
        return value.to(tensor.dtype)

    def _block_into_copy(self, skeleton: nn.Module, prefix: str, keys: dict[str, str]) -> nn.Module:
        """A block of a dispatched model (parameters on the meta device): an empty copy filled in."""
        from accelerate.hooks import remove_hook_from_module

        clone = copy.deepcopy(skeleton)
        remove_hook_from_module(clone, recurse=True)
        clone = clone.to_empty(device="cpu")
        with torch.no_grad(), self._tensors:
            for name, tensor in list(clone.named_parameters()) + list(clone.named_buffers()):
                value = self._block_tensor(keys, prefix, name, tensor)
                if value is not None:
                    tensor.copy_(value)
        return clone

    @contextlib.contextmanager
    def entry_tower(self, reference: nn.Module) -> Iterator[nn.Module]:
        from .parameters import ModelParameters

        tower = self.layer_map.tower(reference)
        parameters = ModelParameters(reference)  # also reaches accelerate-offloaded parameters
        block_params = {id(p) for stack in self.layer_map.stacks(tower) for p in stack.blocks.parameters()}
        keys = self._keys(reference)
        saved: list[tuple[str, torch.Tensor]] = []
        try:
            tower_prefix = self.layer_map.tower_prefix(reference)
            for name, param in tower.named_parameters():
                if id(param) in block_params:
                    continue
                qualified = f"{tower_prefix}.{name}" if tower_prefix else name
                saved.append((qualified, parameters.read(qualified).clone()))
                parameters.write(qualified, self._finite(keys[name], self._read(keys[name])))
            yield tower
        finally:
            for qualified, value in reversed(saved):
                parameters.write(qualified, value)


class LoraSource(ModelSource):
    """An expert given as a LoRA adapter on the base: each block is the base's block plus the adapter's
    deltas, computed per block (no expert is ever materialised in full). Biases the adapter trained
    (`bias="all"` / `"lora_only"`) replace the base's, as PEFT's `merge_and_unload`: in the blocks, and
    in the tower's input path (`entry_tower`). The tensors are `AdapterExpert`'s, the one adapter reader."""

    reader: AdapterExpert  # placed within the merged model's tower on first use (`_tensors`)

    def __init__(self, folder: str, argument: str, name: str, base: ModelSource | None) -> None:
        if base is None:
            raise ValueError(f"`{argument}` is a LoRA adapter: pass the model it was trained on as `base_model`.")
        self.adapter = LoraAdapter(folder, argument)
        self.base, self.argument, self.name, self.config = base, argument, name, base.config
        self.layer_map = base.layer_map
        self._paths: dict[str, str] | None = None

    def _tensors(self, reference: nn.Module) -> dict[str, str]:
        """Tower-relative tensor name → its name for the reader (`AdapterExpert`, the one adapter
        reader, placed within the tower), for every tensor the adapter changes."""
        if self._paths is not None:
            return self._paths
        tower = self.layer_map.tower(reference)
        within = self.layer_map.tower_prefix(reference)
        self.reader = AdapterExpert(self.adapter, reference, self.layer_map, within=within)
        paths = {key[len(within) + 1:] if within else key: key for key in self.reader.tensors}
        block_modules = {
            _qualified_name(tower, block) for stack in self.layer_map.stacks(tower) for block in stack.blocks
        }
        outside = [
            path.rpartition(".")[0] for path, key in paths.items()
            if self.reader.tensors[key][1] == "weight" and not any(path.startswith(b + ".") for b in block_modules)
        ]
        if outside:
            raise ValueError(f"`{self.argument}`: the adapter adapts modules outside the blocks {outside[:3]}; not "
                             "supported.")
        self._paths = paths
        return paths

    def tower_shapes(self, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        self._tensors(reference)  # checks the adapter against the tower
        return self.base.tower_shapes(reference)

    def block(self, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        tower = self.layer_map.tower(reference)
        prefix = _qualified_name(tower, self.layer_map.stacks(tower)[stack].blocks[index]) + "."
        block = copy.deepcopy(self.base.block(reference, stack, index, device))  # never the base's own
        with torch.no_grad():
            for path, key in self._tensors(reference).items():
                if path.startswith(prefix):
                    tensor = block.get_parameter(path[len(prefix):])
                    tensor.copy_(self.reader.value(key, tensor))
        return block.eval()

    @contextlib.contextmanager
    def entry_tower(self, reference: nn.Module) -> Iterator[nn.Module]:
        """The base's input path, with the adapter's trained biases outside the blocks (e.g. a
        pre-LayerNorm's, `bias="all"`) written in for the duration and restored after."""
        from .parameters import ModelParameters

        with self.base.entry_tower(reference) as tower:
            parameters = ModelParameters(tower)  # also reaches accelerate-offloaded parameters
            blocks = {_qualified_name(tower, b) for stack in self.layer_map.stacks(tower) for b in stack.blocks}
            saved: list[tuple[str, torch.Tensor]] = []
            try:
                for path, key in self._tensors(reference).items():
                    if not any(path.startswith(b + ".") for b in blocks):  # only biases (weights: refused)
                        saved.append((path, parameters.read(path).clone()))
                        parameters.write(path, self.reader.value(key))
                yield tower
            finally:
                for name, value in reversed(saved):
                    parameters.write(name, value)

    def modules_for_eval(self) -> list[nn.Module]:
        return self.base.modules_for_eval()

    def check_finite(self, reference: nn.Module) -> None:
        """Nothing more to check: the adapter's tensors were checked when it was opened, the base is
        checked as `base_model`."""

    def digest(self, reference: nn.Module) -> Any:
        return {"adapter": self.adapter.digest(), "base": self.base.digest(reference)}


def make_source(
    source: ModelSource | nn.Module | str | os.PathLike,
    argument: str,
    layer_map: LayerMap,
    base: ModelSource | None = None,
) -> ModelSource:
    """A model → used in memory; a folder or hub id with safetensors → read lazily, one block at a
    time (also open_clip's `local-dir:` / `hf-hub:` checkpoints); a LoRA adapter folder → the base plus
    the adapter's deltas, per block; a checkpoint without safetensors → loaded whole (as `load_model`).
    The source finds its tower and blocks by `layer_map`, the merged model's (a `ModelSource` given
    keeps its own)."""
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, nn.Module):
        return InMemorySource(source, argument, layer_map)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`{argument}` must be a PreTrainedModel, a local path or a hub id, got {type(source).__name__}."
        )
    name = os.fspath(source)
    checkpoint = resolve_checkpoint(name, argument)
    if checkpoint.adapter is not None:
        return LoraSource(checkpoint.adapter, argument, name, base)
    if checkpoint.library is not None and checkpoint.lazy:
        return CheckpointSource(None, argument, name, layer_map, checkpoint.library.describe(), checkpoint.files)
    if checkpoint.lazy:
        return CheckpointSource(checkpoint.folder, argument, name, layer_map, files=checkpoint.files,
                                stored=checkpoint.stored)
    return InMemorySource(load_checkpoint(checkpoint, argument), argument, layer_map, name)


def _qualified_name(root: nn.Module, module: nn.Module) -> str:
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    raise ValueError("module is not inside the tower")


def _is_non_persistent(tower: nn.Module, name: str) -> bool:
    """Whether `name` is a buffer that checkpoints do not store (e.g. position ids)."""
    module_name, _, attr = name.rpartition(".")
    module = tower.get_submodule(module_name) if module_name else tower
    return attr in getattr(module, "_non_persistent_buffers_set", set())
