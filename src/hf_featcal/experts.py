"""Where models come from: in-memory models, local folders or hub ids; and their blocks on the device."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from typing import Any, Union

import torch
import transformers
from torch import nn
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, PreTrainedModel

logger = logging.getLogger(__name__)

ModelLike = Union[nn.Module, str, os.PathLike]


def load_model(source: ModelLike, argument: str, base: ModelLike | None = None) -> nn.Module:
    """The model `source` names: itself if it is a model, else loaded from a local folder or hub id
    with its checkpoint's own class, `trust_remote_code=False`, safetensors preferred.

    A PEFT LoRA adapter folder gives the full expert: a copy of `base` (default: the adapter's
    recorded `base_model_name_or_path`) with the adapter merged in — for evaluation; merging and
    calibration use adapters per block instead.
    """
    if isinstance(source, nn.Module):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`{argument}` must be a PreTrainedModel, a local path or a hub id, got {type(source).__name__}."
        )
    path = os.fspath(source)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _load_adapter_expert(path, argument, base)
    checkpoint = library_checkpoint(path, argument)
    if checkpoint is not None:
        return _load_library_model(checkpoint, argument)
    check_local_path(path, argument)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - re-raised with the argument named
        raise ValueError(f"`{argument}`: cannot load a model config from {path!r}: {err}") from err
    model_class = None
    for name in getattr(config, "architectures", None) or []:
        candidate = getattr(transformers, name, None)
        if isinstance(candidate, type) and issubclass(candidate, PreTrainedModel):
            model_class = candidate
            break
    try:
        if model_class is None:
            return AutoModel.from_pretrained(path, trust_remote_code=False)
        return model_class.from_pretrained(path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"`{argument}`: cannot load the model at {path!r}: {err}") from err


def library_checkpoint(name: str, argument: str) -> Any:
    """The checkpoint of a non-transformers model library (open_clip) that `name` refers to, if any."""
    from .architectures import find_library_checkpoint

    try:
        return find_library_checkpoint(name)
    except Exception as err:  # noqa: BLE001 - re-raised with the argument named
        raise ValueError(f"`{argument}`: cannot read the checkpoint {name!r}: {err}") from err


def _load_library_model(checkpoint: Any, argument: str) -> nn.Module:
    try:
        return checkpoint.load()
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"`{argument}`: cannot load the model {checkpoint.name!r}: {err}") from err


def _load_adapter_expert(folder: str, argument: str, base: ModelLike | None) -> nn.Module:
    from peft import PeftModel

    if base is None:
        with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as handle:
            base = json.load(handle).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"`{argument}` is a LoRA adapter without a recorded base model: pass the base model.")
    model = copy.deepcopy(base) if isinstance(base, nn.Module) else load_model(base, f"base of {argument}")
    return PeftModel.from_pretrained(model, folder).merge_and_unload().eval()


def block_on_device(block: nn.Module, device: torch.device) -> nn.Module:
    """`block` itself when its parameters are already on `device`, else a copy moved there
    (the caller's model is never moved)."""
    params = list(block.parameters())
    if not params or all(p.device == device for p in params):
        return block
    clone = copy.deepcopy(block)
    return clone.to(device)


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (CPU when it has none)."""
    for param in module.parameters():
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
    config, its tower's parameter shapes, one block at a time, and a tower to enter a stack with."""

    argument: str
    config: Any
    name: str | None

    def tower_shapes(self, layer_map: Any, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def block(self, layer_map: Any, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        """Block `index` of stack `stack`, on `device`, in eval mode; never the caller's module moved."""
        raise NotImplementedError

    @contextlib.contextmanager
    def entry_tower(self, layer_map: Any, reference: nn.Module) -> Iterator[nn.Module]:
        """A tower whose input path (everything before the first block of each stack) is this model's."""
        raise NotImplementedError
        yield

    def modules_for_eval(self) -> list[nn.Module]:
        return []

    def digest(self, layer_map: Any, reference: nn.Module) -> Any:
        """Something that changes when the model's weights change (for resume fingerprints)."""
        raise NotImplementedError


class InMemorySource(ModelSource):
    """A model object the caller handed over (or one loaded whole, for non-safetensors checkpoints)."""

    def __init__(self, model: nn.Module, argument: str, name: str | None = None) -> None:
        from .architectures import model_config

        self.model, self.argument, self.config = model, argument, model_config(model)
        self.name = name or getattr(self.config, "_name_or_path", None) or None

    def tower_shapes(self, layer_map: Any, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in layer_map.tower(self.model).state_dict().items()}

    def block(self, layer_map: Any, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        return block_on_device(layer_map.stacks(layer_map.tower(self.model))[stack].blocks[index], device)

    @contextlib.contextmanager
    def entry_tower(self, layer_map: Any, reference: nn.Module) -> Iterator[nn.Module]:
        yield layer_map.tower(self.model)

    def modules_for_eval(self) -> list[nn.Module]:
        return [self.model]

    def digest(self, layer_map: Any, reference: nn.Module) -> Any:
        return layer_map.tower(self.model).state_dict()


class CheckpointSource(ModelSource):
    """A checkpoint folder read lazily with `safetensors.safe_open`: only the tensors of the block in
    use are ever materialised. Blocks are built as copies of the merged model's block (the reference)
    with this checkpoint's tensors loaded into them."""

    def __init__(
        self, folder: str | None, argument: str, name: str, config: Any = None, files: dict[str, str] | None = None
    ) -> None:
        """A transformers checkpoint `folder` (config and safetensors found there), or a library
        checkpoint given by its `config` and `files` (state-dict key → safetensors file)."""
        self.folder, self.argument, self.name = folder, argument, name
        if config is None:
            try:
                config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            except Exception as err:  # noqa: BLE001
                raise ValueError(f"`{argument}`: cannot load a model config from {name!r}: {err}") from err
        self.config = config
        self._files = safetensors_files(folder, argument) if files is None else files
        self._key_map: dict[str, str] | None = None

    # -- keys
    def _keys(self, layer_map: Any, reference: nn.Module) -> dict[str, str]:
        """Tower-relative parameter name → checkpoint key (prefix as the checkpoint has it, ties resolved)."""
        if self._key_map is not None:
            return self._key_map
        tower = layer_map.tower(reference)
        names = list(tower.state_dict().keys())
        tied = {}
        for cls in type(reference).__mro__:
            tied.update(getattr(cls, "_tied_weights_keys", None) or {})
        errors = []
        for prefix in layer_map.checkpoint_prefixes:
            mapping, missing = {}, []
            for name in names:
                key = prefix + name
                if key not in self._files and name in tied and prefix + tied[name] in self._files:
                    key = prefix + tied[name]
                if key in self._files:
                    mapping[name] = key
                elif not _is_non_persistent(tower, name):
                    missing.append(name)
            if not missing:
                self._key_map = mapping
                return mapping
            errors.append(f"prefix {prefix!r}: missing {missing[:3]}")
        raise ValueError(
            f"`{self.argument}` ({self.name}) lacks parameters of the merged model's tower ({'; '.join(errors)})."
        )

    def _read(self, key: str) -> torch.Tensor:
        with open_safetensors(self._files[key], self.argument) as handle:
            return handle.get_tensor(key)

    def tower_shapes(self, layer_map: Any, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for name, key in self._keys(layer_map, reference).items():
            with open_safetensors(self._files[key], self.argument) as handle:
                shapes[name] = tuple(handle.get_slice(key).get_shape())
        return shapes

    def digest(self, layer_map: Any, reference: nn.Module) -> Any:
        from .checkpointing import file_digest

        files = sorted(set(self._files.values()))
        return [(os.path.basename(f), file_digest(f)) for f in files]

    # -- blocks and entry
    def block(self, layer_map: Any, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        tower = layer_map.tower(reference)
        skeleton = layer_map.stacks(tower)[stack].blocks[index]
        prefix = _qualified_name(tower, skeleton)
        keys = self._keys(layer_map, reference)
        clone = copy.deepcopy(skeleton)
        if any(p.is_meta for p in clone.parameters()):  # an offloaded block of a dispatched merged model
            from accelerate.hooks import remove_hook_from_module

            remove_hook_from_module(clone, recurse=True)
            clone = clone.to_empty(device="cpu")
        with torch.no_grad():
            for name, tensor in list(clone.named_parameters()) + list(clone.named_buffers()):
                key = keys.get(f"{prefix}.{name}")
                if key is None:
                    if isinstance(tensor, nn.Parameter):
                        raise ValueError(f"`{self.argument}` ({self.name}) has no tensor for {prefix}.{name}")
                    continue
                tensor.copy_(self._read(key).to(tensor.dtype))
        return clone.to(device).eval()

    @contextlib.contextmanager
    def entry_tower(self, layer_map: Any, reference: nn.Module) -> Iterator[nn.Module]:
        from .offload import ModelParameters

        tower = layer_map.tower(reference)
        parameters = ModelParameters(reference)  # also reaches accelerate-offloaded parameters
        block_params = {id(p) for stack in layer_map.stacks(tower) for p in stack.blocks.parameters()}
        keys = self._keys(layer_map, reference)
        saved: list[tuple[str, torch.Tensor]] = []
        try:
            tower_prefix = layer_map.tower_prefix(reference)
            for name, param in tower.named_parameters():
                if id(param) in block_params:
                    continue
                qualified = f"{tower_prefix}.{name}" if tower_prefix else name
                saved.append((qualified, parameters.read(qualified).clone()))
                parameters.write(qualified, self._read(keys[name]))
            yield tower
        finally:
            for qualified, value in reversed(saved):
                parameters.write(qualified, value)


class LoraAdapter:
    """A PEFT LoRA adapter folder: per adapted Linear, the weight delta (B·A)·scaling, read lazily."""

    _UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "layer_replication", "target_parameters",
                    "trainable_token_indices")

    def __init__(self, folder: str, argument: str) -> None:
        self.folder, self.argument = folder, argument
        with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as handle:
            self.config = json.load(handle)
        if self.config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"`{argument}`: only LoRA adapters are supported, got peft_type {self.config['peft_type']!r}.")
        used = [key for key in self._UNSUPPORTED if self.config.get(key)]
        if used:
            raise ValueError(f"`{argument}`: LoRA adapters using {used} are not supported.")
        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"`{argument}`: {folder!r} has no adapter_model.safetensors.")
        self._path = path
        with open_safetensors(path, argument) as handle:
            keys = list(handle.keys())
        suffix = ".lora_A.weight"
        # module path as the adapter names it (relative to the model it was trained on)
        self.modules = [k[len("base_model.model."):-len(suffix)] for k in keys if k.endswith(suffix)]

    def _scaling(self, module: str, rank: int) -> float:
        alpha = self.config.get("lora_alpha", 8)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def delta(self, module: str) -> torch.Tensor:
        """(B·A)·scaling of one adapted module, in float32 (out × in)."""
        with safe_open(self._path, framework="pt") as handle:
            a = handle.get_tensor(f"base_model.model.{module}.lora_A.weight").float()
            b = handle.get_tensor(f"base_model.model.{module}.lora_B.weight").float()
        delta = (b @ a) * self._scaling(module, a.shape[0])
        return delta.T if self.config.get("fan_in_fan_out") else delta

    def digest(self) -> Any:
        from .checkpointing import file_digest

        return [(os.path.basename(self._path), file_digest(self._path))]


class LoraSource(ModelSource):
    """An expert given as a LoRA adapter on the base: each block is the base's block plus the adapter's
    deltas, computed per block (no expert is ever materialised in full)."""

    def __init__(self, folder: str, argument: str, name: str, base: ModelSource | None) -> None:
        if base is None:
            raise ValueError(f"`{argument}` is a LoRA adapter: pass the model it was trained on as `base_model`.")
        self.adapter = LoraAdapter(folder, argument)
        self.base, self.argument, self.name, self.config = base, argument, name, base.config
        self._paths: dict[str, str] | None = None

    def _module_paths(self, layer_map: Any, reference: nn.Module) -> dict[str, str]:
        """Tower-relative module path → the adapter's module path, for every adapted module."""
        if self._paths is not None:
            return self._paths
        tower = layer_map.tower(reference)
        tower_modules = {name for name, _ in tower.named_modules()}
        paths = {}
        for module in self.adapter.modules:
            matches = [module[len(p):] for p in layer_map.checkpoint_prefixes if module.startswith(p) and module[len(p):] in tower_modules]
            if not matches:
                raise ValueError(f"`{self.argument}`: the adapter adapts {module!r}, which is not part of the calibrated tower.")
            paths[matches[0]] = module
        block_modules = {
            _qualified_name(tower, block) for stack in layer_map.stacks(tower) for block in stack.blocks
        }
        outside = [p for p in paths if not any(p.startswith(b + ".") for b in block_modules)]
        if outside:
            raise ValueError(f"`{self.argument}`: the adapter adapts modules outside the blocks {outside[:3]}; not supported.")
        self._paths = paths
        return paths

    def tower_shapes(self, layer_map: Any, reference: nn.Module) -> dict[str, tuple[int, ...]]:
        self._module_paths(layer_map, reference)  # checks the adapter against the tower
        return self.base.tower_shapes(layer_map, reference)

    def block(self, layer_map: Any, reference: nn.Module, stack: int, index: int, device: torch.device) -> nn.Module:
        tower = layer_map.tower(reference)
        prefix = _qualified_name(tower, layer_map.stacks(tower)[stack].blocks[index]) + "."
        block = copy.deepcopy(self.base.block(layer_map, reference, stack, index, device))  # never the base's own
        with torch.no_grad():
            for path, adapter_path in self._module_paths(layer_map, reference).items():
                if path.startswith(prefix):
                    weight = block.get_submodule(path[len(prefix):]).weight
                    weight.add_(self.adapter.delta(adapter_path).to(device=weight.device, dtype=weight.dtype))
        return block.eval()

    @contextlib.contextmanager
    def entry_tower(self, layer_map: Any, reference: nn.Module) -> Iterator[nn.Module]:
        with self.base.entry_tower(layer_map, reference) as tower:  # adapters only change blocks
            yield tower

    def modules_for_eval(self) -> list[nn.Module]:
        return self.base.modules_for_eval()

    def digest(self, layer_map: Any, reference: nn.Module) -> Any:
        return {"adapter": self.adapter.digest(), "base": self.base.digest(layer_map, reference)}


def make_source(
    source: ModelSource | nn.Module | str | os.PathLike, argument: str, base: ModelSource | None = None
) -> ModelSource:
    """A model → used in memory; a folder or hub id with safetensors → read lazily, one block at a
    time (also open_clip's `local-dir:` / `hf-hub:` checkpoints); a LoRA adapter folder → the base plus
    the adapter's deltas, per block; a checkpoint without safetensors → loaded whole (as `load_model`)."""
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, nn.Module):
        return InMemorySource(source, argument)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`{argument}` must be a PreTrainedModel, a local path or a hub id, got {type(source).__name__}."
        )
    name = os.fspath(source)
    checkpoint = library_checkpoint(name, argument)
    if checkpoint is not None:
        if checkpoint.files:
            return CheckpointSource(None, argument, name, checkpoint.describe(), checkpoint.files)
        return InMemorySource(_load_library_model(checkpoint, argument), argument, name)
    check_local_path(name, argument)
    folder = name if os.path.isdir(name) else hub_snapshot(name)
    if folder is not None and os.path.isfile(os.path.join(folder, "adapter_config.json")):
        return LoraSource(folder, argument, name, base)
    if folder is not None and safetensors_files(folder, argument):
        return CheckpointSource(folder, argument, name)
    return InMemorySource(load_model(source, argument), argument, name)


def hub_snapshot(repo_id: str) -> str | None:
    """A local snapshot of a hub repository's config and safetensors files, None if unavailable
    (offline, unknown id): callers then fall back to `load_model`, which produces the user-facing error."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:  # noqa: BLE001
        logger.debug("snapshot of %s failed: %s", repo_id, err)
        return None


SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def config_field(folder: str, key: str) -> Any:
    """The value of `key` in the folder's config.json; None when there is no such file or field, or the
    file is not a JSON object (callers that need the config itself report that)."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as handle:
            return json.load(handle).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def weights_file(folder: str) -> tuple[str | None, bool]:
    """The weights file transformers' `from_pretrained` reads in a checkpoint folder, and whether it is
    a shard index: `transformers_weights` named in config.json, else `model.safetensors`, else
    `model.safetensors.index.json` (so a single file wins over a stale index left by an earlier sharded
    save). (None, False) when there is none."""
    explicit = config_field(folder, "transformers_weights")  # the config loader reports a broken config.json
    if isinstance(explicit, str) and explicit:
        path = os.path.join(folder, explicit)
        base = os.path.abspath(folder)
        if os.path.commonpath([base, os.path.abspath(path)]) != base:
            raise ValueError(f"config.json names weights outside the model folder: transformers_weights={explicit!r}")
        if explicit.endswith(".safetensors.index.json"):
            return path, True
        return (path, False) if explicit.endswith(".safetensors") else (None, False)
    single = os.path.join(folder, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return single, False
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        return index, True
    return None, False


@contextlib.contextmanager
def open_safetensors(path: str, argument: str | None = None) -> Iterator[Any]:
    """`safe_open(path)`, with a damaged or missing file reported as a ValueError naming it (and the argument)."""
    from safetensors import SafetensorError

    where = f"`{argument}`: " if argument else ""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{where}cannot read the safetensors file {path!r}: {err}") from None
    with handle:
        yield handle


def safetensors_files(folder: str, argument: str | None = None) -> dict[str, str]:
    """Checkpoint key → safetensors file of a checkpoint folder, from the file `weights_file` picks
    (the one transformers would load): a shard index or the single file. The one place both the
    calibration readers and the mergers decide which weights a folder holds."""
    where = f"`{argument}`: " if argument else ""
    try:
        path, sharded = weights_file(folder)
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    if path is None:
        return {}
    if not sharded:
        with open_safetensors(path, argument) as handle:
            return {key: path for key in handle.keys()}
    try:
        with open(path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{where}cannot read the shard index {path!r}: {type(err).__name__}: {err}") from None
    files = {key: os.path.join(os.path.dirname(path), file) for key, file in weight_map.items()}
    missing = sorted({f for f in files.values() if not os.path.isfile(f)})
    if missing:
        raise ValueError(f"{where}the shard index {path!r} lists files that do not exist: {missing[:3]}")
    return files


def _looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a hub id ('name' or 'org/name') or a
    library reference with a scheme ('hf-hub:org/name', 'local-dir:/path')."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", name):
        return False
    return os.path.isabs(os.path.expanduser(name)) or name.startswith(".") or name.count("/") > 1 or "\\" in name


def check_local_path(name: str, argument: str) -> None:
    """Refuse a path meant as a local folder that does not exist (instead of a hub error about repo ids)."""
    if not os.path.exists(name) and _looks_local(name):
        raise ValueError(f"`{argument}`: cannot load a model config from {name!r}: no such local folder.")


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
