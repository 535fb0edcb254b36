"""Model I/O shared by merging, calibration and evaluation: what a model reference points at, which
files hold its weights, how a checkpoint's keys map onto a model's, and one lazy per-tensor reader.

One place decides each of these, so that a folder `from_pretrained` loads as expert A is merged and
calibrated as expert A too:

* `resolve_checkpoint`: a library checkpoint (open_clip `local-dir:` / `hf-hub:` / a folder with
  `open_clip_config.json`), a PEFT LoRA adapter folder, a transformers folder or hub snapshot with
  safetensors, or one that must be loaded whole (`load_model`).
* `weights_file` / `safetensors_files`: the weights transformers 5 reads in a folder
  (`transformers_weights`, then `model.safetensors`, then the shard index).
* `transformers_names`: the names `from_pretrained` gives a folder's stored keys (transformers'
  checkpoint conversion mapping, e.g. ViT's legacy names), which the lazy readers use.
* `LazyTensors`: shapes, dtypes and values of single tensors, never a whole state dict.
* Key rules: `prefix_candidates` (family prefixes first, then the "" and derived ones) behind both
  `find_key_prefix` / `match_keys` (merging: every expert key must land in the base) and
  `tower_key_map` (calibration: every tower tensor must be found); `lora_module_paths` maps a LoRA
  adapter's modules onto a model (its recorded `base_model_class`, then the family's tower, then the
  model itself; the adapter's own leading prefixes such as a `*ForCausalLM`'s `model.` stripped), and
  `AdapterExpert` is the one reader of an adapter expert's weights on the run's base.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._kernels.finite import all_finite
from .saving import repair_interrupted_save

logger = logging.getLogger(__name__)

#: A model, or where to load it from (local folder or hub id).
ModelLike = nn.Module | str | os.PathLike

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


# ---------------------------------------------------------------------------------------- locating
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


def hub_snapshot(repo_id: str) -> str | None:
    """A local snapshot of a hub repository's config and safetensors files, None if unavailable
    (offline, unknown id): callers then fall back to `load_model`, which produces the user-facing error."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:  # noqa: BLE001
        logger.debug("snapshot of %s failed: %s", repo_id, err)
        return None


def library_checkpoint(name: str, argument: str) -> Any:
    """The checkpoint of a non-transformers model library (open_clip) that `name` refers to, if any."""
    from .architectures import find_library_checkpoint

    try:
        return find_library_checkpoint(name)
    except Exception as err:
        raise ValueError(f"`{argument}`: cannot read the checkpoint {name!r}: {err}") from err


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
    from safetensors import SafetensorError, safe_open

    where = f"`{argument}`: " if argument else ""
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{where}cannot read the safetensors file {path!r}: {err}") from None
    with handle:
        yield handle


def safetensors_files(folder: str, argument: str | None = None) -> dict[str, str]:
    """Checkpoint key → safetensors file of a checkpoint folder, from the file `weights_file` picks
    (the one transformers would load): a shard index or the single file."""
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


@dataclass
class Checkpoint:
    """What a model reference (path, hub id, library reference) points at; exactly one of `library`
    (a model library's own checkpoint), `adapter` (a LoRA adapter folder) or `folder` describes it.
    `files` (tensor name, as the model's class names it → safetensors file; `stored` gives the key in
    the file where the two differ) is empty when the model can only be loaded whole."""

    name: str
    folder: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    library: Any = None
    adapter: str | None = None
    #: the model's name of a tensor → the key it is stored under, where they differ (`transformers_names`)
    stored: dict[str, str] = field(default_factory=dict)

    @property
    def lazy(self) -> bool:
        """Whether its tensors can be read one at a time."""
        return bool(self.files)


def resolve_checkpoint(source: str | os.PathLike, argument: str) -> Checkpoint:
    """The one decision of what `source` is, for merging and calibration alike: a library checkpoint
    first (open_clip), then a local folder or hub snapshot holding a LoRA adapter, then one with the
    safetensors `weights_file` picks; else a checkpoint to load whole (`files` empty)."""
    name = os.fspath(source)
    library = library_checkpoint(name, argument)
    if library is not None:
        return Checkpoint(name, files=dict(library.files), library=library)
    check_local_path(name, argument)
    if os.path.isdir(name):
        repair_interrupted_save(name)
    folder = name if os.path.isdir(name) else hub_snapshot(name)
    if folder is not None and os.path.isfile(os.path.join(folder, ADAPTER_CONFIG_NAME)):
        return Checkpoint(name, adapter=folder)
    files = safetensors_files(folder, argument) if folder is not None else {}
    names = transformers_names(folder, files) if folder is not None and files else {}
    if names is None:  # a conversion that changes tensors: only `from_pretrained` applies it
        return Checkpoint(name, folder=folder)
    return Checkpoint(name, folder=folder, files={names[key]: file for key, file in files.items()},
                      stored={names[key]: key for key in files if names[key] != key})


_NAMES_CACHE: dict[tuple, dict[str, str] | None] = {}


def transformers_names(folder: str, keys: Collection[str]) -> dict[str, str] | None:
    """Stored key → the name `from_pretrained` gives the tensor with the checkpoint's own class. Since
    transformers 5 a model's modules may be named otherwise than its checkpoints: loading renames the
    keys by the library's checkpoint conversion mapping (`transformers.conversion_mapping.
    get_model_conversion_mapping`: ViT's `encoder.layer.N.attention.attention.query` → `layers.N.
    attention.q_proj`, legacy `LayerNorm.gamma` → `.weight`, CLIP's `vision_model.` prefix), and
    saving writes the old names back. The lazy readers name tensors the same way, applying the same
    mapping (`rename_source_key`, as `from_pretrained` does). Every key keeps its name where the folder
    has no config or its class is not transformers' own; None when a key needs a conversion that
    changes tensors (a `WeightConverter`: fused or split weights) or two keys would get one name: such
    a checkpoint is loaded whole."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return {key: key for key in keys}
    cache_key = (os.path.realpath(folder), os.stat(config_path).st_mtime_ns, tuple(sorted(keys)))
    if cache_key not in _NAMES_CACHE:
        _NAMES_CACHE[cache_key] = _transformers_names(folder, keys)
    return _NAMES_CACHE[cache_key]


def _transformers_names(folder: str, keys: Collection[str]) -> dict[str, str] | None:
    from transformers import AutoConfig, AutoModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        model_class = _checkpoint_class(config)
        with torch.device("meta"):  # the module names and conversions alone: no tensor is allocated
            model = model_class._from_config(config) if model_class is not None else AutoModel.from_config(config)
    except (ValueError, KeyError, TypeError, OSError, ImportError, AttributeError):
        # not a model transformers builds from its config (its loader names its tensors as stored)
        return {key: key for key in keys}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    names = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, prefix, meta_state)
        if converted is not None:
            return None
        if name not in meta_state and key in meta_state:  # as `from_pretrained`: a key that should not be renamed
            name, _ = rename_source_key(key, [], [], prefix, meta_state)
        names[key] = name
    if len(set(names.values())) != len(names):
        return None
    return names


def _checkpoint_class(config: Any) -> Any:
    """The transformers class a config's `architectures` names (None: none of them is one)."""
    import transformers
    from transformers import PreTrainedModel

    for name in getattr(config, "architectures", None) or []:
        candidate = getattr(transformers, name, None)
        if isinstance(candidate, type) and issubclass(candidate, PreTrainedModel):
            return candidate
    return None


# ---------------------------------------------------------------------------------------- loading whole
def load_model(
    source: ModelLike, argument: str, base: ModelLike | None = None, *, auto_class: Any = None
) -> nn.Module:
    """The model `source` names: itself if it is a model, else loaded from a local folder or hub id
    with its checkpoint's own class (or `auto_class`, e.g. `AutoModelForSeq2SeqLM`, when given),
    `trust_remote_code=False`, safetensors preferred.

    A PEFT LoRA adapter folder (local or a hub snapshot) gives the full expert: a copy of `base`
    (default: the adapter's recorded `base_model_name_or_path`) with the adapter's tensors written in
    by `AdapterExpert`, the reader merging and calibration use per tensor / per block.
    """
    if isinstance(source, nn.Module):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`{argument}` must be a PreTrainedModel, a local path or a hub id, got {type(source).__name__}."
        )
    path = os.fspath(source)
    checkpoint = resolve_checkpoint(path, argument)  # also repairs a save killed between its renames
    if checkpoint.adapter is not None:
        return _load_adapter_expert(checkpoint.adapter, argument, base, auto_class)
    if checkpoint.library is not None:
        return load_checkpoint(checkpoint, argument)
    from transformers import AutoConfig, AutoModel

    model_class = auto_class
    if model_class is None:
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except Exception as err:
            raise ValueError(f"`{argument}`: cannot load a model config from {path!r}: {err}") from err
        model_class = _checkpoint_class(config)
    try:
        return (model_class or AutoModel).from_pretrained(path, trust_remote_code=False)
    except Exception as err:
        raise ValueError(f"`{argument}`: cannot load the model at {path!r}: {err}") from err


def load_checkpoint(checkpoint: Checkpoint, argument: str) -> nn.Module:
    """The whole model of a resolved checkpoint (for one without safetensors to read lazily)."""
    if checkpoint.library is None:
        return load_model(checkpoint.name, argument)
    try:
        return checkpoint.library.load()
    except Exception as err:
        raise ValueError(f"`{argument}`: cannot load the model {checkpoint.library.name!r}: {err}") from err


def _load_adapter_expert(folder: str, argument: str, base: ModelLike | None, auto_class: Any) -> nn.Module:
    if base is None:
        with open(os.path.join(folder, ADAPTER_CONFIG_NAME), encoding="utf-8") as handle:
            base = json.load(handle).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"`{argument}` is a LoRA adapter without a recorded base model: pass the base model.")
    if isinstance(base, nn.Module):
        model = copy.deepcopy(base)
    else:
        model = load_model(base, f"base of {argument}", auto_class=auto_class)
    adapter = AdapterExpert(LoraAdapter(folder, argument), model, family_layer_map(model))
    state = model.state_dict()  # shares storage with the model's parameters and buffers
    with torch.no_grad():
        for key in adapter.tensors:
            state[key].copy_(adapter.value(key, state[key]))
    return model.eval()


# ---------------------------------------------------------------------------------------- lazy tensors
class LazyTensors:
    """Single tensors of safetensors files (checkpoint key → file), read on demand. Inside `with`
    the files stay open (one handle each); outside, every call opens and closes its file."""

    def __init__(self, files: Mapping[str, str], argument: str | None = None,
                 stored: Mapping[str, str] | None = None) -> None:
        self.files, self.argument = dict(files), argument
        self.stored = dict(stored or {})  # name → the key in the file, where they differ (`Checkpoint.stored`)
        self._handles: dict[str, Any] | None = None
        self._stack: contextlib.ExitStack | None = None
        self._depth = 0  # nested `with`: the files close when the outermost exits

    def __enter__(self) -> LazyTensors:
        self._depth += 1
        if self._depth == 1:
            self._stack = contextlib.ExitStack()
            self._handles = {}
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        stack, self._stack, self._handles = self._stack, None, None
        if stack is not None:
            stack.close()

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, key: object) -> bool:
        return key in self.files

    @contextlib.contextmanager
    def _handle(self, key: str) -> Iterator[Any]:
        path = self.files[key]
        if self._handles is None:
            with open_safetensors(path, self.argument) as handle:
                yield handle
            return
        if path not in self._handles:
            assert self._stack is not None
            self._handles[path] = self._stack.enter_context(open_safetensors(path, self.argument))
        yield self._handles[path]

    def shape(self, key: str) -> tuple[int, ...]:
        with self._handle(key) as handle:
            return tuple(handle.get_slice(self.stored.get(key, key)).get_shape())

    def is_floating(self, key: str) -> bool:
        with self._handle(key) as handle:  # F16/BF16/F32/F64/F8_*
            return handle.get_slice(self.stored.get(key, key)).get_dtype().startswith(("F", "BF"))

    def read(self, key: str) -> torch.Tensor:
        with self._handle(key) as handle:
            return handle.get_tensor(self.stored.get(key, key))


# ---------------------------------------------------------------------------------------- key rules
def prefix_candidates(outer: Collection[str], probe: str, preferred: Sequence[str] = ()) -> list[str]:
    """Prefixes `p` worth trying so that `p + name` is an `outer` key: the `preferred` ones (a family's
    checkpoint prefixes) in their order, then "", then those under which `probe` occurs in `outer`,
    shortest first."""
    derived = sorted(
        {k[: len(k) - len(probe)] for k in outer if k.endswith(probe) and len(k) > len(probe)},
        key=lambda p: (len(p), p),
    )
    return list(dict.fromkeys([*preferred, "", *derived]))


def find_key_prefix(
    base_keys: set[str] | Mapping[str, object], expert_keys: set[str] | Mapping[str, object]
) -> str | None:
    """Return the prefix ``p`` such that ``p + k`` is a base key for every expert key ``k``.

    ``""`` is returned when the key sets line up directly.  Candidate prefixes are derived from
    base keys that end with an expert key (e.g. ``"vision_model."`` for a ``CLIPModel`` base and
    ``CLIPVisionModel`` experts); the shortest prefix that maps *all* expert keys wins.  Returns
    ``None`` when no prefix maps every expert key.
    """
    base, expert = set(base_keys), set(expert_keys)
    if not expert:
        return None
    for prefix in prefix_candidates(base, min(expert)):  # min(): any key works, this one is deterministic
        if all(prefix + k in base for k in expert):
            return prefix
    return None


def _shared_leading_prefixes(keys: Sequence[str]) -> list[str]:
    """"", then every leading dotted prefix all `keys` share (shortest first; never a whole key)."""
    common: list[str] = []
    # strict=False: keys differ in depth, and only the depth all of them reach can be shared
    for column in zip(*(k.split(".")[:-1] for k in keys), strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    return ["".join(c + "." for c in common[:depth]) for depth in range(len(common) + 1)]


def match_keys(base_keys: set[str], expert_keys: Iterable[str]) -> dict[str, str] | None:
    """Expert key → base key for *every* expert key, or None.  First ``find_key_prefix`` on the keys
    as they are, then with a leading dotted prefix that all expert keys share stripped (shortest first),
    e.g. the ``vision_model.`` of a transformers-4.x ``CLIPVisionModel`` checkpoint."""
    keys = sorted(expert_keys)
    if not keys:
        return None
    for strip in _shared_leading_prefixes(keys):
        stripped = {k[len(strip):]: k for k in keys}
        prefix = find_key_prefix(base_keys, stripped)
        if prefix is not None:
            return {original: prefix + short for short, original in stripped.items()}
    return None


def tower_key_map(
    names: Sequence[str],
    checkpoint_keys: Collection[str],
    preferred: Sequence[str] = ("",),
    tied: Mapping[str, str] | None = None,
    optional: Collection[str] = (),
) -> tuple[dict[str, str] | None, list[str]]:
    """Tower tensor name → checkpoint key for *every* name but the `optional` ones (buffers checkpoints
    do not store), under one prefix from `prefix_candidates` (the family's `preferred` ones first); a
    name absent under the prefix may be found as its tied partner (`tied`). Returns (mapping, []) or
    ({}, one line per preferred prefix saying what it misses)."""
    tied = tied or {}
    checkpoint = set(checkpoint_keys)
    required = [n for n in names if n not in optional]
    probe = min((n for n in required if n not in tied), default=min(required, default=""))
    errors = []
    for prefix in prefix_candidates(checkpoint, probe, preferred):
        mapping, missing = {}, []
        for name in names:
            key = prefix + name
            if key not in checkpoint and name in tied and prefix + tied[name] in checkpoint:
                key = prefix + tied[name]
            if key in checkpoint:
                mapping[name] = key
            elif name not in optional:
                missing.append(name)
        if not missing:
            return mapping, []
        if prefix in preferred:
            errors.append(f"prefix {prefix!r}: missing {missing[:3]}")
    return None, errors


# ---------------------------------------------------------------------------------------- LoRA adapters
class LoraAdapter:
    """A PEFT LoRA adapter folder: per adapted Linear, the weight delta (B·A)·scaling, read lazily."""

    _UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "layer_replication", "target_parameters",
                    "trainable_token_indices")

    def __init__(self, folder: str, argument: str) -> None:
        self.folder, self.argument = folder, argument
        with open(os.path.join(folder, ADAPTER_CONFIG_NAME), encoding="utf-8") as handle:
            self.config = json.load(handle)
        if self.config.get("peft_type", "LORA") != "LORA":
            raise ValueError(
                f"`{argument}`: only LoRA adapters are supported, got peft_type {self.config['peft_type']!r}."
            )
        used = [key for key in self._UNSUPPORTED if self.config.get(key)]
        if used:
            raise ValueError(f"`{argument}`: LoRA adapters using {used} are not supported.")
        path = os.path.join(folder, ADAPTER_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"`{argument}`: {folder!r} has no {ADAPTER_WEIGHTS_NAME}.")
        self._path = path
        with open_safetensors(path, argument) as handle:
            self._shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        self._tensors = LazyTensors(dict.fromkeys(self._shapes, path), argument)
        with self._tensors:  # an adapter is small: every tensor is checked now, before any use of it
            for key in self._shapes:
                if not all_finite(self._tensors.read(key)):
                    raise ValueError(
                        f"`{argument}`: the LoRA adapter {folder!r} has non-finite values (NaN/Inf) in {key!r}."
                    )
        suffix = ".lora_A.weight"
        # module path as the adapter names it (relative to the model it was trained on)
        self.modules = [k[len(_PEFT_PREFIX):-len(suffix)] for k in self._shapes if k.endswith(suffix)]
        # biases trained with `bias="all"` / `"lora_only"`: PEFT loads them over the model's own
        # (`<module>.bias`, or `<module>.base_layer.bias` for an adapted Linear), so the expert's bias
        # is the stored value itself; module path (as above) -> the adapter's key
        self.biases: dict[str, str] = {}
        unknown = []
        for key in self._shapes:
            if re.search(r"\.lora_[AB]\.weight$", key):
                continue
            if key.startswith(_PEFT_PREFIX) and key.endswith(".bias"):
                module = key[len(_PEFT_PREFIX):-len(".bias")]
                self.biases[module[: -len(".base_layer")] if module.endswith(".base_layer") else module] = key
            else:
                unknown.append(key)
        if unknown:  # never dropped silently: an expert without them is not the adapter PEFT applies
            raise ValueError(
                f"`{argument}`: the LoRA adapter {folder!r} holds tensors other than LoRA A/B weights and biases, "
                f"which are not supported: {unknown[:3]}"
            )

    @property
    def trained_on(self) -> str | None:
        """The class name of the model the adapter was trained on, when PEFT recorded it."""
        return (self.config.get("auto_mapping") or {}).get("base_model_class")

    def weight_shape(self, module: str) -> tuple[int, int]:
        """The leading two dimensions of the adapted module's weight: (out, in) — (in, out) with
        `fan_in_fan_out` — for Linear and convolution weights alike."""
        rank_in = self._shapes[f"{_PEFT_PREFIX}{module}.lora_A.weight"]
        out_rank = self._shapes[f"{_PEFT_PREFIX}{module}.lora_B.weight"]
        shape = (out_rank[0], rank_in[1])
        return shape[::-1] if self.config.get("fan_in_fan_out") else shape

    def _scaling(self, module: str, rank: int) -> float:
        alpha = self.config.get("lora_alpha", 8)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def delta(self, module: str) -> torch.Tensor:
        """(B·A)·scaling of one adapted module, in float32 (out × in)."""
        a = self._tensors.read(f"{_PEFT_PREFIX}{module}.lora_A.weight").float()
        b = self._tensors.read(f"{_PEFT_PREFIX}{module}.lora_B.weight").float()
        delta = (b @ a) * self._scaling(module, a.shape[0])
        return delta.T if self.config.get("fan_in_fan_out") else delta

    def bias_shape(self, module: str) -> tuple[int, ...]:
        return self._shapes[self.biases[module]]

    def bias(self, module: str) -> torch.Tensor:
        """The trained bias of `module` (`bias="all"` / `"lora_only"`): the expert's bias, replacing the
        model's own as PEFT's `merge_and_unload` does, in float32."""
        return self._tensors.read(self.biases[module]).float()

    def digest(self) -> Any:
        """What the expert's weights depend on, for resume fingerprints: the A/B weights and biases, and
        adapter_config.json (`lora_alpha`, `alpha_pattern`, `use_rslora`, `fan_in_fan_out` and the
        target modules change the deltas without changing a weight file)."""
        from .checkpointing import file_digest

        # the config as read (its values, not its layout: a file rewritten with the same values is the same expert)
        return [(os.path.basename(self._path), file_digest(self._path)),
                (ADAPTER_CONFIG_NAME, json.dumps(self.config, sort_keys=True))]


def lora_module_paths(
    adapter: LoraAdapter, model: nn.Module, layer_map: Any = None, within: str = ""
) -> tuple[str, dict[str, str]]:
    """(root, adapter module path → qualified module path in `model`) for every module the adapter changes
    (`adapter.modules`, whose weights it adapts, and `adapter.biases`, whose biases it replaces), under one
    rule for merging and calibration: the model-side root is, in order, the submodule of the class the
    adapter records it was trained on, the family's tower (`layer_map`), the model itself; the
    adapter-side prefix stripped is "" or one of the family's checkpoint prefixes (a `*ForCausalLM`'s
    `model.`, a transformers-4 / `CLIPModel` `vision_model.`). The first (root, prefix) under which
    every adapted module exists with the adapted weight's shape wins; `within` restricts the roots to
    one submodule (the calibrated tower). ValueError naming the adapter when none does."""
    weights = {
        name: tuple(module.weight.shape[:2])
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
    }
    biases = {
        name: tuple(m.bias.shape)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "bias", None), torch.Tensor)
    }
    trained_on = adapter.trained_on
    recorded = (
        next((n for n, m in model.named_modules() if type(m).__name__ == trained_on), None) if trained_on else None
    )
    roots: list[str] = [] if recorded is None else [recorded]
    strips: list[str] = [""]
    if layer_map is not None:
        roots.append(layer_map.tower_prefix(model))
        strips += list(layer_map.checkpoint_prefixes)
    roots.append("")
    if within:
        nested = recorded is None or not recorded or f"{recorded}.".startswith(f"{within}.") \
            or within.startswith(f"{recorded}.")  # inside the tower, or around it (e.g. the whole CLIPModel)
        if not nested:
            raise ValueError(
                f"`{adapter.argument}`: the LoRA adapter was trained on {trained_on} ({recorded!r}), which is not "
                f"part of the calibrated tower {within!r}."
            )
        roots = [r for r in roots if r == within or r.startswith(within + ".")] or [within]
    # (module, where its shape is looked up, the shape the adapter needs there)
    needs: list[tuple[str, dict[str, tuple[int, ...]], tuple[int, ...]]]
    needs = [(m, weights, adapter.weight_shape(m)) for m in adapter.modules]
    needs += [(m, biases, adapter.bias_shape(m)) for m in adapter.biases]
    for root in dict.fromkeys(roots):
        for strip in dict.fromkeys(strips):
            paths = {}
            for module, found, shape in needs:
                if not module.startswith(strip):
                    break
                path = ".".join(p for p in (root, module[len(strip):]) if p)
                if found.get(path) != shape:
                    break
                paths[module] = path
            else:
                return root, paths
    first = next(iter(dict.fromkeys(roots)))
    missing = [m for m, found, shape in needs if found.get(".".join(p for p in (first, m) if p)) != shape]
    where = f"the submodule {within!r} of " if within else ""
    raise ValueError(
        f"`{adapter.argument}`: the LoRA adapter adapts modules that {where}the model lacks (or with other "
        f"shapes): {missing[:3]}"
    )


class AdapterExpert:
    """The one reader of an expert given as a LoRA adapter, on the run's base: which tensors of `model`
    (the run's base, or a model of its architecture) the adapter changes, and their values. Merging
    (`merging.engine.open_expert`: merges, SVC), FeatCal's per-block reading (`experts.LoraSource`) and
    whole experts (`load_model`: compare, post-merging steps, evaluation) all read adapters here, so an
    adapter is the same weights on every path: as PEFT's `merge_and_unload` on that base, an adapted
    weight is the base's plus (B·A)·scaling, a trained bias (`bias="all"` / `"lora_only"`) replaces the
    base's. Modules are placed by `lora_module_paths` (`layer_map`, `within` as there)."""

    def __init__(self, adapter: LoraAdapter, model: nn.Module, layer_map: Any = None, within: str = "") -> None:
        self.adapter = adapter
        self.root, paths = lora_module_paths(adapter, model, layer_map, within=within)
        #: qualified tensor name in `model` → (the adapter's module path, "weight" | "bias")
        self.tensors: dict[str, tuple[str, str]] = {f"{paths[m]}.weight": (m, "weight") for m in adapter.modules}
        self.tensors.update({f"{paths[m]}.bias": (m, "bias") for m in adapter.biases})

    def value(self, key: str, base_value: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's tensor `key` (a name in `tensors`) in float32, on `base_value`'s device: the
        run's base value of that weight (`base_value`) plus the adapter's delta, or the trained bias
        (the base's bias is not used)."""
        module, kind = self.tensors[key]
        if kind == "bias":
            return self.adapter.bias(module)
        if base_value is None:
            raise ValueError(f"`{self.adapter.argument}`: the base value of {key!r} is needed to apply the adapter.")
        return base_value.float() + self.adapter.delta(module).to(base_value.device)


def family_layer_map(model: nn.Module) -> Any:
    """The layer map of `model`'s family, None when the library has none for it (merging works on any model)."""
    from .architectures import get_layer_map

    try:
        return get_layer_map(model)
    except ValueError:
        return None
