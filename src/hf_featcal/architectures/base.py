"""What a layer map is: the architecture knowledge FeatCal needs, and nothing else.

A layer map says where the blocks are, how a stream enters the first block of a stack, how a block
is replayed and what it passes on, which token a head pools, which modules are key/value
projections and which modules read the same input. The calibrator only talks to this interface.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..pipeline.streams import StreamBatch, capture_first_block_inputs
from .mha import attention_out_proj_called

LINEAR = "linear"
LAYER_NORM = "layer_norm"
RMS_NORM = "rms_norm"


@dataclass(frozen=True)
class ModuleSpec:
    """A calibratable Linear or norm of a block, named relative to the block.

    Most specs are a module with `weight` (and `bias`) parameters. A *packed* Linear — the fused
    query/key/value in-projection of `nn.MultiheadAttention` — is described by the module holding its
    parameters, their attribute names and the rows of the packed weight this spec owns; its input is
    captured at another module (`reads`).
    """

    name: str
    kind: str  # LINEAR, LAYER_NORM or RMS_NORM
    module: str | None = None  # the module holding the parameters (default: `name`)
    weight_attr: str = "weight"
    bias_attr: str = "bias"
    rows: tuple[int, int] | None = None  # [start, stop) of the packed weight's rows (default: all)
    reads: str | None = None  # the module whose input is this spec's input (default: the module)

    @property
    def owner(self) -> str:
        """The block-relative name of the module holding the parameters."""
        return self.name if self.module is None else self.module

    @property
    def capture(self) -> str:
        """The block-relative name of the module whose input this spec reads."""
        return self.owner if self.reads is None else self.reads

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other names selecting this spec in `target_modules` / `exclude_modules`: a packed
        projection's own name (`attn.in_proj` for `attn.in_proj.q`)."""
        return (self.name.rsplit(".", 1)[0],) if self.rows is not None else ()

    def attributes(self, block: nn.Module) -> list[str]:
        """The parameter attributes of the owner module this spec writes (weight, and bias if present)."""
        module = block.get_submodule(self.owner)
        return [a for a in (self.weight_attr, self.bias_attr) if isinstance(getattr(module, a, None), Tensor)]

    def value(self, block: nn.Module, attr: str = "weight") -> Tensor | None:
        """This spec's weight or bias (attr 'weight' / 'bias') in `block`, None for a missing bias."""
        tensor = getattr(block.get_submodule(self.owner), self.weight_attr if attr == "weight" else self.bias_attr,
                         None)
        if tensor is None:
            return None
        tensor = tensor.detach()
        return tensor if self.rows is None else tensor[self.rows[0] : self.rows[1]]

    def shape(self, block: nn.Module) -> tuple[int, int]:
        """(out_features, in_features) of a Linear spec."""
        weight = self.value(block)
        assert weight is not None  # a Linear spec's owner has a weight (the map found it there)
        return int(weight.shape[0]), int(weight.shape[1])


@dataclass(frozen=True)
class Stack:
    """A run of blocks traversed in forward order (CLIP: the vision encoder; T5: encoder, then decoder)."""

    name: str
    blocks: nn.ModuleList
    pooled_token_index: int | None = None  # the token a head reads after this stack, if any


def packed_attention_specs(name: str, attention: nn.MultiheadAttention) -> list[ModuleSpec]:
    """The query, key and value rows of an `nn.MultiheadAttention`'s packed in-projection as three
    Linear specs (`<name>.in_proj.q/k/v`) reading the attention's query input (self-attention).
    Together they are the packed projection solved as one Linear: the closed form is row-separable,
    so splitting only matters where rows get different token weights (the pooled last block)."""
    if not attention._qkv_same_embed_dim:
        raise ValueError(
            f"{name}: nn.MultiheadAttention with separate q/k/v projection weights (kdim/vdim != embed_dim) "
            "is not supported."
        )
    d = attention.embed_dim
    return [
        ModuleSpec(f"{name}.in_proj.{part}", LINEAR, module=name, weight_attr="in_proj_weight",
                   bias_attr="in_proj_bias", rows=(i * d, (i + 1) * d), reads=name)
        for i, part in enumerate("qkv")
    ]


@dataclass
class LibraryCheckpoint:
    """A checkpoint in a model library's own format (not a transformers one), recognised by a layer map."""

    name: str
    load: Callable[[], nn.Module]  # the whole model
    files: dict[str, str] = field(default_factory=dict)  # state-dict key → safetensors file ({} if none)
    # what `LayerMap.describe` gives for the model, computed only when `files` are read lazily
    describe: Callable[[], Any] | None = None


#: How a representation is taken from its module's output: the whole output (one vector per example),
#: one token of a sequence (`token_index`), or every weighted position of a sequence.
VECTOR, TOKEN, POSITIONS = "vector", "token", "positions"

#: The forwards a representation point may name (`RepresentationPoint.architecture`): how its model runs
#: on a batch. `post_merging.representation.ARCHITECTURES` implements each.
REPRESENTATION_FORWARDS = ("clip", "open_clip", "encoder", "seq2seq", "decoder_lm")


@dataclass(frozen=True)
class RepresentationPoint:
    """Where a model's representation is (the tensor a task's head reads, which post-merging
    corrections such as Representation Surgery move): the output of module `module` (qualified name,
    "" for the model itself), taken as a whole (`selection` "vector"), at token `token_index`
    ("token") or at the weighted positions ("positions"); `dim` features per row; `architecture` says
    which forward runs the model (one of `REPRESENTATION_FORWARDS`); `description` is for people."""

    architecture: str
    module: str
    selection: str
    dim: int
    token_index: int | None = None
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RepresentationPoint:
        known = {name: values[name] for name in cls.__dataclass_fields__ if name in values}
        point = cls(**known)
        if point.architecture not in REPRESENTATION_FORWARDS or point.selection not in (VECTOR, TOKEN, POSITIONS):
            raise ValueError(f"unknown representation point {dict(values)!r}")
        return point


def config_hidden_size(config: Any) -> int:
    """The width of a model's hidden states, from its config (`hidden_size`, `d_model` or `projection_dim`)."""
    for name in ("hidden_size", "d_model", "projection_dim"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the hidden size of {type(config).__name__}")


def qualified(prefix: str, name: str) -> str:
    """`name` inside the module `prefix` ('' for the model itself)."""
    return f"{prefix}.{name}" if prefix else name


class LayerMap:
    """Base class of the per-architecture layer maps. Subclasses set the class attributes and
    implement `tower`; the defaults cover a plain stack of transformer blocks."""

    #: `config.model_type` values this map handles.
    model_types: tuple[str, ...] = ()  # not ClassVar: an inferred map sets it per model
    #: Model classes without a transformers config (`module.QualName`) this map handles.
    model_classes: ClassVar[tuple[str, ...]] = ()
    #: The library that loads a saved model back (the model card's `library_name`).
    library_name: ClassVar[str] = "transformers"
    #: Batch keys the tower's forward takes.
    input_names: ClassVar[tuple[str, ...]] = ()
    #: The batch key whose leading dimension counts examples.
    main_input_name: str = "input_ids"  # not ClassVar: an inferred map sets it per model
    #: Key/value projections (block-relative names): they keep weight 1 for every token in the last
    #: block of a pooled-head model, because the pooled token attends to all tokens.
    key_value_modules: ClassVar[tuple[str, ...]] = ()
    #: Groups of block-relative module names that read the same input tensor.
    shared_input_groups: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: Config fields that must agree between the merged model and every expert / base.
    config_fields: ClassVar[tuple[str, ...]] = ()
    #: Norm classes (by class name) that are RMS norms: scale only, no centring.
    rms_norm_classes: tuple[str, ...] = ()  # not ClassVar: an inferred map sets it per model
    #: Whether `for_batches` specialises the map from every task's batches (so the calibrator must see
    #: them all before any stream enters a stack).
    plans_from_batches: ClassVar[bool] = False

    # ---------------------------------------------------------------- structure
    def tower(self, model: nn.Module) -> nn.Module:
        """The part of `model` that FeatCal calibrates (the whole model for most architectures)."""
        return model

    def tower_config(self, config: Any) -> Any:
        """The part of a model's config that describes the tower's geometry."""
        return config

    def describe(self, model: nn.Module) -> Any:
        """The model's config (for models without a transformers config: one built from its modules)."""
        return model.config

    @classmethod
    def find_checkpoint(cls, name: str) -> LibraryCheckpoint | None:
        """The checkpoint of this map's own model library that `name` (a path or hub reference) refers
        to, None if it is not one (transformers checkpoints need no map: they are found by their config)."""
        return None

    def save_model(self, model: nn.Module, output_dir: str | os.PathLike) -> None:
        """Save a calibrated model the way its library loads it back (`save_pretrained` here)."""
        model.save_pretrained(output_dir)  # type: ignore[operator]  # a transformers model's method

    def records_processing(self, processing_class: Any, output_dir: str) -> bool:
        """Whether the model files `save_model` wrote into `output_dir` already record
        `processing_class`, which has no ``save_pretrained`` (open_clip: its config file does)."""
        return False

    def pipeline_tag(self, model: nn.Module) -> str | None:
        """The hub pipeline tag of `model` when the map's library decides it (None: from transformers'
        task mapping)."""
        return None

    #: Key prefixes under which a checkpoint of this family may store the tower's tensors, tried in order.
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("",)

    def tower_prefix(self, model: nn.Module) -> str:
        """The tower's qualified name inside `model` ('' when the tower is the model)."""
        tower = self.tower(model)
        for name, module in model.named_modules():
            if module is tower:
                return name
        raise ValueError("the tower is not a submodule of the model")

    def stacks(self, tower: nn.Module) -> list[Stack]:
        """The tower's stacks in forward order."""
        raise NotImplementedError

    def block_modules(self, block: nn.Module) -> list[ModuleSpec]:
        """Every Linear and normalisation layer with parameters in `block`, in registration order.
        The packed in-projection of an `nn.MultiheadAttention` counts as three Linears (its query,
        key and value rows), which read the attention's query input."""
        specs = []
        for name, module in block.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                specs += packed_attention_specs(name, module)
            elif isinstance(module, nn.Linear):
                specs.append(ModuleSpec(name, LINEAR))
            elif isinstance(module, nn.LayerNorm) and module.weight is not None:
                specs.append(ModuleSpec(name, LAYER_NORM))
            elif type(module).__name__ in self.rms_norm_classes:
                specs.append(ModuleSpec(name, RMS_NORM))
        return specs

    def norm_eps(self, module: nn.Module) -> float:
        """The epsilon a norm module adds to the variance."""
        for attr in ("eps", "variance_epsilon", "epsilon"):
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
        raise ValueError(f"cannot find the epsilon of norm {type(module).__name__}")

    def capture_context(self, block: nn.Module) -> contextlib.AbstractContextManager:
        """Entered around every forward whose module inputs are captured. The default makes every
        `nn.MultiheadAttention` of the block call its `out_proj` as a module, so a hook sees its input."""
        return attention_out_proj_called(block)

    def compatibility(self, config: Any) -> dict[str, Any]:
        """The geometry (from a model's config) that must agree between models calibrated together."""
        config = self.tower_config(config)
        return {name: getattr(config, name, None) for name in self.config_fields}

    def representation_point(self, model: nn.Module) -> RepresentationPoint | None:
        """Where the representation a task's head reads is in `model`, for post-merging corrections
        (Representation Surgery, ProbSurgery); None (the default) when the map knows no such point."""
        return None

    def pooled_token_point(self, model: nn.Module, module: str, what: str) -> RepresentationPoint:
        """The representation of a model whose head reads the last stack's pooled token
        (`Stack.pooled_token_index`) in the output of `module` (relative to the tower)."""
        stack = self.stacks(self.tower(model))[-1]
        index = stack.pooled_token_index
        if index is None:
            raise ValueError(f"`model` ({type(model).__name__}): the layer map's last stack pools no token")
        return RepresentationPoint("encoder", qualified(self.tower_prefix(model), module), TOKEN,
                                   config_hidden_size(getattr(model, "config", None)), token_index=index,
                                   description=f"the pooled token ({index}) {what}: what the head reads")

    # ---------------------------------------------------------------- streams
    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The part of a batch the tower's forward takes."""
        return {k: v for k, v in batch.items() if k in self.input_names}

    def forward_tower(self, tower: nn.Module, batch: Mapping[str, Any]) -> Any:
        """Run the tower's own forward on a batch (streams are captured at a stack's first block)."""
        return tower(**self.model_inputs(batch))

    def token_weights(self, batch: Mapping[str, Any], hidden: Tensor, stack: Stack) -> Tensor:
        """Per-token weights (B, N) of a stack's positions: 1 for real tokens, 0 for padding."""
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor) and mask.shape == hidden.shape[:2]:
            return mask.to(device=hidden.device, dtype=torch.float32)
        return torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.float32)

    def input_weights(self, module_name: str, state: StreamBatch) -> Tensor:
        """Token weights (B, N_in) of the positions a module reads. Default: the stream's own positions;
        a module reading another sequence (cross-attention keys/values) overrides this."""
        assert state.weights is not None  # `enter_stack` gives every stream its weights
        return state.weights

    def required_batch_keys(self, model: nn.Module) -> tuple[str, ...]:
        """Batch keys every calibration batch for `model` must have."""
        return (self.main_input_name,)

    def weight_source(self, module_name: str) -> str:
        """Which token weights a module's statistics use; modules reading one input with different
        weight sources get separate statistics. Default: one source for every module."""
        return "tokens"

    def for_batches(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> LayerMap:
        """The layer map to plan and run with for these calibration batches (every task's), asked
        once before the blocks are planned. A map whose statistics grouping depends on the batches
        returns a specialised copy; the map itself is never changed. Default: itself."""
        return self

    def check_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        """Raise ValueError if a calibration batch lacks something `model` needs."""
        missing = [name for name in self.required_batch_keys(model) if name not in batch]
        if missing:
            raise ValueError(f"the batch lacks {missing} (keys: {sorted(batch)})")

    def enter_stack(
        self, tower: nn.Module, batch: Mapping[str, Any], stack_index: int, previous: StreamBatch | None
    ) -> StreamBatch:
        """The stream's input to the first block of stack `stack_index`, as `tower`'s own forward
        builds it. `previous` is the same stream's final state in the preceding stack."""
        stack = self.stacks(tower)[stack_index]
        args, kwargs = capture_first_block_inputs(lambda: self.forward_tower(tower, batch), stack.blocks[0])
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return StreamBatch(
            hidden=hidden,
            args=tuple(args[1:]),
            kwargs=kwargs,
            weights=self.token_weights(batch, hidden, stack),
        )

    def run_block(self, block: nn.Module, block_index: int, state: StreamBatch) -> StreamBatch:
        """Replay one block on a stream; returns the stream's state after the block."""
        out = block(state.hidden, *state.args, **state.kwargs)
        hidden = out[0] if isinstance(out, (tuple, list)) else out
        return replace(state, hidden=hidden)


@dataclass
class _Registry:
    maps: dict[str, type[LayerMap]] = field(default_factory=dict)
    classes: dict[str, type[LayerMap]] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_layer_map(cls: type[LayerMap]) -> type[LayerMap]:
    """Class decorator: make `cls` the layer map of every model type and model class it lists."""
    for model_type in cls.model_types:
        _REGISTRY.maps[model_type] = cls
    for model_class in cls.model_classes:
        _REGISTRY.classes[model_class] = cls
    return cls


def supported_model_types() -> list[str]:
    """Model types with a registered layer map."""
    return sorted(_REGISTRY.maps)


def _class_name(model: Any) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def get_layer_map(model: Any, argument: str = "model") -> LayerMap:
    """The layer map for a model (or a model config), chosen by its `model_type`, or for a model
    without a transformers config by its class."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    if model_type in _REGISTRY.maps:
        return _REGISTRY.maps[model_type]()
    if isinstance(model, nn.Module) and _class_name(model) in _REGISTRY.classes:
        return _REGISTRY.classes[_class_name(model)]()
    name = type(model).__name__ if isinstance(model, nn.Module) else "config"
    raise ValueError(
        f"`{argument}` has unsupported architecture {name} (model_type={model_type!r}); "
        f"supported model types: {', '.join(supported_model_types())}; "
        f"supported model classes: {', '.join(sorted(_REGISTRY.classes))}."
    )


def layer_map_or_none(model: Any) -> LayerMap | None:
    """The layer map of `model`, None when no registered map handles it."""
    try:
        return get_layer_map(model)
    except ValueError:
        return None


def processing_recorded(processing_class: Any, output_dir: str, model: Any = None) -> bool:
    """Whether the model files in `output_dir` already record `processing_class` (`LayerMap.records_processing`
    of `model`'s map; `model` None: of any registered map)."""
    if model is not None:
        found = layer_map_or_none(model)
        return found is not None and found.records_processing(processing_class, output_dir)
    maps = dict.fromkeys([*_REGISTRY.maps.values(), *_REGISTRY.classes.values()])
    return any(cls().records_processing(processing_class, output_dir) for cls in maps)


def find_library_checkpoint(name: str) -> LibraryCheckpoint | None:
    """The library checkpoint (e.g. open_clip) that a path or hub reference names, if a layer map knows it."""
    for cls in dict.fromkeys(_REGISTRY.classes.values()):
        checkpoint = cls.find_checkpoint(name)
        if checkpoint is not None:
            return checkpoint
    return None


def model_config(model: nn.Module) -> Any:
    """A model's config: its transformers config, or for a class-registered model the config its
    layer map describes (None when neither exists)."""
    config = getattr(model, "config", None)
    if config is not None:
        return config
    if _class_name(model) in _REGISTRY.classes:
        return _REGISTRY.classes[_class_name(model)]().describe(model)
    return None
