"""What a layer map is: the architecture knowledge FeatCal needs, and nothing else.

A layer map says where the blocks are, how a stream enters the first block of a stack, how a block
is replayed and what it passes on, which token a head pools, which modules are key/value
projections and which modules read the same input. The calibrator only talks to this interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..streams import StreamBatch, capture_first_block_inputs

LINEAR = "linear"
LAYER_NORM = "layer_norm"
RMS_NORM = "rms_norm"


@dataclass(frozen=True)
class ModuleSpec:
    """A calibratable module of a block, named relative to the block."""

    name: str
    kind: str  # LINEAR, LAYER_NORM or RMS_NORM


@dataclass(frozen=True)
class Stack:
    """A run of blocks traversed in forward order (CLIP: the vision encoder; T5: encoder, then decoder)."""

    name: str
    blocks: nn.ModuleList
    pooled_token_index: int | None = None  # the token a head reads after this stack, if any


class LayerMap:
    """Base class of the per-architecture layer maps. Subclasses set the class attributes and
    implement `tower`; the defaults cover a plain stack of transformer blocks."""

    #: `config.model_type` values this map handles.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: Batch keys the tower's forward takes.
    input_names: ClassVar[tuple[str, ...]] = ()
    #: The batch key whose leading dimension counts examples.
    main_input_name: ClassVar[str] = "input_ids"
    #: Key/value projections (block-relative names): they keep weight 1 for every token in the last
    #: block of a pooled-head model, because the pooled token attends to all tokens.
    key_value_modules: ClassVar[tuple[str, ...]] = ()
    #: Groups of block-relative module names that read the same input tensor.
    shared_input_groups: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: Config fields that must agree between the merged model and every expert / base.
    config_fields: ClassVar[tuple[str, ...]] = ()
    #: Norm classes (by class name) that are RMS norms: scale only, no centring.
    rms_norm_classes: ClassVar[tuple[str, ...]] = ()

    # ---------------------------------------------------------------- structure
    def tower(self, model: nn.Module) -> nn.Module:
        """The part of `model` that FeatCal calibrates (the whole model for most architectures)."""
        return model

    def tower_config(self, config: Any) -> Any:
        """The part of a model's config that describes the tower's geometry."""
        return config

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
        """Every Linear and normalisation layer with parameters in `block`, in registration order."""
        specs = []
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
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

    def compatibility(self, config: Any) -> dict[str, Any]:
        """The geometry (from a model's config) that must agree between models calibrated together."""
        config = self.tower_config(config)
        return {name: getattr(config, name, None) for name in self.config_fields}

    # ---------------------------------------------------------------- streams
    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The part of a batch the tower's forward takes."""
        return {k: v for k, v in batch.items() if k in self.input_names}

    def token_weights(self, batch: Mapping[str, Any], hidden: Tensor, stack: Stack) -> Tensor:
        """Per-token weights (B, N) of a stack's positions: 1 for real tokens, 0 for padding."""
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor) and mask.shape == hidden.shape[:2]:
            return mask.to(device=hidden.device, dtype=torch.float32)
        return torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.float32)

    def input_weights(self, module_name: str, state: StreamBatch) -> Tensor:
        """Token weights (B, N_in) of the positions a module reads. Default: the stream's own positions;
        a module reading another sequence (cross-attention keys/values) overrides this."""
        return state.weights

    def required_batch_keys(self, model: nn.Module) -> tuple[str, ...]:
        """Batch keys every calibration batch for `model` must have."""
        return (self.main_input_name,)

    def weight_source(self, module_name: str) -> str:
        """Which token weights a module's statistics use; modules reading one input with different
        weight sources get separate statistics. Default: one source for every module."""
        return "tokens"

    def observe_batches(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> None:
        """Called with every task's calibration batches before the blocks are planned."""

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
        inputs = self.model_inputs(batch)
        args, kwargs = capture_first_block_inputs(lambda: tower(**inputs), stack.blocks[0])
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


_REGISTRY = _Registry()


def register_layer_map(cls: type[LayerMap]) -> type[LayerMap]:
    """Class decorator: make `cls` the layer map of every model type it lists."""
    for model_type in cls.model_types:
        _REGISTRY.maps[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    """Model types with a registered layer map."""
    return sorted(_REGISTRY.maps)


def get_layer_map(model: Any, argument: str = "model") -> LayerMap:
    """The layer map for a model (or a model config), chosen by its `model_type`."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY.maps:
        name = type(model).__name__ if isinstance(model, nn.Module) else "config"
        raise ValueError(
            f"`{argument}` has unsupported architecture {name} (model_type={model_type!r}); "
            f"supported model types: {', '.join(supported_model_types())}."
        )
    return _REGISTRY.maps[model_type]()
