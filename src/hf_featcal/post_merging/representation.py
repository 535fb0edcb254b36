"""How to compute "the representation the task's head reads", and where it is.

Post-merging steps that correct a merged model's features (Representation Surgery, ProbSurgery) work on
one tensor per input: the representation a task's head reads. Where it is, per architecture, is the
layer map's knowledge (`LayerMap.representation_point`, in `architectures/<name>.py`; the reasons are in
docs/surgery.md): `representation_point(model)` asks the model's layer map for the module whose output
holds it and how to take it from that output. `representations(model, batches, point)` runs the model's
own forward on calibration batches and returns the representation, one row per example (or per weighted
position); `replace_representation` is what a correction hook does with the module's output at
inference. Training and inference therefore read and write the same tensor.

A position-wise representation (T5, Llama) is corrected at every position at inference (the correction
acts on one vector at a time); it is trained on the weighted positions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch import Tensor, nn

from ..architectures import POSITIONS, TOKEN, RepresentationPoint, get_layer_map, layer_map_or_none, model_type_of
from ..experts import module_device
from ..hooks import eval_mode
from ..pipeline.streams import StopForward


# ---------------------------------------------------------------------------- which point
def representation_point(model: nn.Module) -> RepresentationPoint:
    """The representation the task's head reads in `model`, as its layer map declares it
    (`LayerMap.representation_point`). Raises a ValueError naming the model's class for an architecture
    without one."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    layer_map = layer_map_or_none(model)
    point = layer_map.representation_point(model) if layer_map is not None else None
    if point is None:
        model_type = model_type_of(model)
        raise ValueError(
            f"`model` ({type(model).__name__}, model_type={model_type!r}) has no known representation point: "
            "post-merging representation corrections support CLIP, open_clip, BERT/RoBERTa, ViT, T5 and "
            "Llama-family models."
        )
    return point


# ---------------------------------------------------------------------------- forwards and positions
def _clip_forward(model: Any, batch: Mapping[str, Any]) -> None:
    if hasattr(model, "get_image_features"):
        model.get_image_features(pixel_values=batch["pixel_values"])
    else:
        model(pixel_values=batch["pixel_values"])


def _open_clip_forward(model: Any, batch: Mapping[str, Any]) -> None:
    visual = getattr(model, "visual", model)
    visual(batch["pixel_values"])


def _encoder_forward(model: Any, batch: Mapping[str, Any]) -> None:
    model(**get_layer_map(model).model_inputs(batch))


def _seq2seq_forward(model: Any, batch: Mapping[str, Any]) -> None:
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
    if getattr(model, "decoder", None) is not None:
        decoder_input_ids = batch.get("decoder_input_ids")
        if decoder_input_ids is None:
            decoder_input_ids = model._shift_right(batch["labels"])
        inputs.update(decoder_input_ids=decoder_input_ids,
                      decoder_attention_mask=batch.get("decoder_attention_mask"), use_cache=False)
    model(**inputs)


def _decoder_lm_forward(model: Any, batch: Mapping[str, Any]) -> None:
    model(**get_layer_map(model).model_inputs(batch))


def _seq2seq_weights(model: nn.Module, batch: Mapping[str, Any], hidden: Tensor) -> Tensor:
    if getattr(model, "decoder", None) is not None:
        weights = (batch["labels"] != -100).float()
        if batch.get("decoder_attention_mask") is not None:
            weights = weights * batch["decoder_attention_mask"].float()
        return weights
    mask = batch.get("attention_mask")
    return torch.ones(hidden.shape[:2]) if mask is None else mask.float()


def _decoder_lm_weights(model: nn.Module, batch: Mapping[str, Any], hidden: Tensor) -> Tensor:
    layer_map = get_layer_map(model)
    stack = layer_map.stacks(layer_map.tower(model))[0]
    return layer_map.token_weights(batch, hidden, stack)


@dataclass(frozen=True)
class _Architecture:
    forward: Callable[[Any, Mapping[str, Any]], None]
    required: tuple[str, ...]  # batch keys the forward needs
    weights: Callable[[nn.Module, Mapping[str, Any], Tensor], Tensor] | None = None  # POSITIONS only


#: Architecture name of a `RepresentationPoint` (`REPRESENTATION_FORWARDS`) → how its model runs on a batch.
ARCHITECTURES: dict[str, _Architecture] = {
    "clip": _Architecture(_clip_forward, ("pixel_values",)),
    "open_clip": _Architecture(_open_clip_forward, ("pixel_values",)),
    "encoder": _Architecture(_encoder_forward, ()),
    "seq2seq": _Architecture(_seq2seq_forward, ("input_ids",), _seq2seq_weights),
    "decoder_lm": _Architecture(_decoder_lm_forward, ("input_ids",), _decoder_lm_weights),
}


def required_batch_keys(model: nn.Module, point: RepresentationPoint) -> tuple[str, ...]:
    """Batch keys every batch must have for `representations` of `model` at `point`."""
    keys = ARCHITECTURES[point.architecture].required
    if point.architecture == "encoder":
        keys = (get_layer_map(model).main_input_name,)
    if point.architecture == "seq2seq" and getattr(model, "decoder", None) is not None:
        keys = (*keys, "labels")
    return keys


# ---------------------------------------------------------------------------- the output tensor
def main_tensor(output: Any) -> Tensor:
    """The tensor a module's output carries: itself, the first item of a tuple / list, or the first
    field of a `ModelOutput`."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    if isinstance(output, Mapping):
        first = next(iter(output.values()), None)
        if isinstance(first, Tensor):
            return first
    raise TypeError(f"cannot find the representation tensor in a {type(output).__name__} output")


def with_main_tensor(output: Any, tensor: Tensor) -> Any:
    """`output` with its main tensor (`main_tensor`) replaced by `tensor`."""
    if isinstance(output, Tensor):
        return tensor
    if isinstance(output, (tuple, list)):
        return type(output)([tensor, *output[1:]]) if isinstance(output, list) else (tensor, *output[1:])
    key = next(iter(output.keys()))
    replaced = output.__class__(**{**output, key: tensor})
    return replaced


def replace_representation(output: Any, point: RepresentationPoint, correct: Callable[[Tensor], Tensor]) -> Any:
    """The module output with its representation replaced by `correct(representation)`: the whole output
    (vector), the pooled token only (token), or every position (positions: the correction is row-wise)."""
    tensor = main_tensor(output)
    if point.selection == TOKEN:
        assert point.token_index is not None  # a token point names its token
        corrected = tensor.clone()
        corrected[:, point.token_index] = correct(tensor[:, point.token_index])
        return with_main_tensor(output, corrected)
    return with_main_tensor(output, correct(tensor))


# ---------------------------------------------------------------------------- computing
def check_point_module(model: nn.Module, point: RepresentationPoint, argument: str = "model") -> nn.Module:
    """The module `point` names inside `model`, refused with a ValueError naming `argument` when absent."""
    try:
        return model.get_submodule(point.module)
    except AttributeError:
        raise ValueError(
            f"`{argument}` ({type(model).__name__}) has no module {point.module!r}, where the representation "
            f"({point.description or point.selection}) is read"
        ) from None


@contextlib.contextmanager
def _capture_output(module: nn.Module, store: list[Any], stop: bool) -> Iterator[None]:
    def hook(mod: nn.Module, args: tuple, output: Any) -> None:
        store.append(output)
        if stop:  # what runs after the representation (heads, lm_head) is not needed
            raise StopForward

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def representations(
    model: nn.Module, batches: Sequence[Mapping[str, Any]], point: RepresentationPoint | None = None,
    *, argument: str = "model",
) -> Tensor:
    """The representation of every example of `batches` in `model` (eval mode, no gradients): a
    `[rows, point.dim]` float32 tensor on the model's device, one row per example (vector, token) or per
    weighted position (positions), in batch order. Uses `model`'s own forward, cut short right after
    the representation's module (heads and `lm_head` do not run); the model's training flags are
    restored afterwards."""
    point = representation_point(model) if point is None else point
    module = check_point_module(model, point, argument)
    architecture = ARCHITECTURES[point.architecture]
    device = module_device(model)
    rows = []
    with eval_mode(model):
        for batch in batches:
            batch = send_to_device(dict(batch), device)
            store: list[Any] = []
            with _capture_output(module, store, stop=module is not model):
                try:
                    architecture.forward(model, batch)
                except StopForward:
                    pass
            if not store:
                raise RuntimeError(f"the forward of `{argument}` never reached {point.module!r}")
            tensor = main_tensor(store[0])
            if point.selection == TOKEN:
                tensor = tensor[:, point.token_index]
            elif point.selection == POSITIONS:
                assert architecture.weights is not None  # every positions architecture weighs its positions
                weights = architecture.weights(model, batch, tensor).to(tensor.device)
                tensor = tensor[weights > 0]
            rows.append(tensor.float())
    return torch.cat(rows)
