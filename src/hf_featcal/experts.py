"""Where models come from: in-memory models, local folders or hub ids; and their blocks on the device."""

from __future__ import annotations

import copy
import os
from typing import Union

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

ModelSource = Union[nn.Module, str, os.PathLike]


def load_model(source: ModelSource, argument: str) -> nn.Module:
    """The model `source` names: itself if it is a model, else loaded from a local folder or hub id
    with its checkpoint's own class, `trust_remote_code=False`, safetensors preferred."""
    if isinstance(source, nn.Module):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`{argument}` must be a PreTrainedModel, a local path or a hub id, got {type(source).__name__}."
        )
    path = os.fspath(source)
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
