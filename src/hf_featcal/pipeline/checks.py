"""Checks of the calibrator's arguments, run at construction before any block is touched: errors
name the offending argument (and task and batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch import Tensor, nn

from .._kernels.convolutions import patch_products
from ..architectures import LayerMap, get_layer_map, model_type_of
from ..data import Batch, batch_size_of
from ..experts import ModelSource
from ..hooks import eval_mode
from .context import RunContext
from .streams import TaskStreams


def check_tasks(experts: Any, calibration_data: Any) -> list[str]:
    """The task names (every task has an expert and data)."""
    if not isinstance(experts, Mapping) or not experts:
        raise ValueError("`experts` must be a non-empty mapping task name → expert model, local path or hub id.")
    if not isinstance(calibration_data, Mapping) or not calibration_data:
        raise ValueError("`calibration_data` must be a non-empty mapping task name → Dataset or iterable of batches.")
    no_data = [t for t in experts if t not in calibration_data]
    no_expert = [t for t in calibration_data if t not in experts]
    if no_data:
        raise ValueError(f"tasks {no_data} have an expert in `experts` but no entry in `calibration_data`.")
    if no_expert:
        raise ValueError(f"tasks {no_expert} have data in `calibration_data` but no expert in `experts`.")
    return list(experts)


def check_not_empty(task: str, batches: list[Batch]) -> None:
    """A task's calibration data gave at least one batch."""
    if not batches:
        raise ValueError(f"calibration_data[{task!r}] is empty: at least one example per task is needed.")


#: Config fields that may differ between models merged or calibrated together, because they do not
#: change the function the weights compute (names, labels and their heads' bookkeeping, storage dtype,
#: library version, output and cache switches, the attention kernel, tokenizer and generation ids,
#: initialisation, whether a decoder exists; and every field whose name holds "dropout", "pdrop",
#: "drop_path" or "layerdrop", the identity at inference). Every other field of a transformers config
#: must be equal (`function_differences`).
FUNCTION_NEUTRAL_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "architectures", "transformers_version", "torch_dtype",
    "dtype", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "task_specific_params",
    "use_cache", "output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_return_dict",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
    "tokenizer_class", "prefix", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "initializer_range", "initializer_factor", "logit_scale_init_value",
    "gradient_checkpointing", "chunk_size_feed_forward", "pretraining_tp",
    # whether the model has a decoder besides its encoder (T5EncoderModel vs T5ForConditionalGeneration):
    # which parts exist, which the key and shape matching decides; the shared parts compute the same
    "is_encoder_decoder",
})


def _neutral(field: str) -> bool:
    return (field in FUNCTION_NEUTRAL_FIELDS or field.startswith("hf_featcal_")
            or any(word in field for word in ("dropout", "pdrop", "drop_path", "layerdrop")))


def function_differences(ours: Any, theirs: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Field → (ours, theirs) for every field of two transformers configs (or their dicts) that changes
    the function (`FUNCTION_NEUTRAL_FIELDS` are left out): `model_type`, the geometry, activation, norm
    eps, rope_theta / rope_scaling, tied embeddings, ... ; a mapping (a sub-config, `rope_parameters`)
    field by field. A
    field only one of them has (an older transformers' config) is not compared. Configs without
    `to_dict` (open_clip's geometry): nothing here, `LayerMap.compatibility` compares them."""
    mine = ours.to_dict() if hasattr(ours, "to_dict") else ours
    other = theirs.to_dict() if hasattr(theirs, "to_dict") else theirs
    if not isinstance(mine, dict) or not isinstance(other, dict):
        return {}
    found: dict[str, tuple[Any, Any]] = {}
    for field in mine.keys() & other.keys():
        if _neutral(field):
            continue
        a, b = mine[field], other[field]
        if isinstance(a, dict) and isinstance(b, dict):  # a sub-config, rope_parameters: field by field
            found.update(function_differences(a, b, f"{prefix}{field}."))
        elif a != b:
            found[prefix + field] = (a, b)
    return found


def check_same_function(argument: str, merged_config: Any, config: Any, what: str = "merged") -> None:
    """`config` (of `argument`) computes the function of `merged_config` (the `what` model's): a
    ValueError naming the argument, each field and both values otherwise (`function_differences`)."""
    diff = function_differences(merged_config, config)
    if diff:
        detail = ", ".join(f"{k}: {what} {a!r} vs {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(
            f"`{argument}` has a different configuration from the {what} model ({detail}): it computes another "
            "function, so its weights cannot be merged or calibrated with it (the fields that may differ: "
            "hf_featcal.pipeline.checks.FUNCTION_NEUTRAL_FIELDS)."
        )


def check_compatible(source: ModelSource, layer_map: LayerMap, model: nn.Module, merged_config: Any) -> None:
    """`source` (an expert or the base) has the merged model's architecture, configuration (every field
    that changes the function, `check_same_function`, of the tower's config) and tower shapes."""
    argument = source.argument
    if model_type_of(source.config) == model_type_of(merged_config):
        other_map = layer_map  # also an inferred one
    else:
        other_map = get_layer_map(source.config, argument)
    if type(other_map) is not type(layer_map):
        raise ValueError(
            f"`{argument}` has model_type {model_type_of(source.config)!r}, which does not match the merged "
            f"{type(model).__name__} (model_type {model_type_of(merged_config)!r})."
        )
    ours, theirs = layer_map.compatibility(merged_config), other_map.compatibility(source.config)
    diff = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
    if diff:
        detail = ", ".join(f"{k}: merged {a!r} vs {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"`{argument}` has a different configuration from the merged model ({detail}).")
    check_same_function(argument, layer_map.tower_config(merged_config), other_map.tower_config(source.config))
    mine = {k: tuple(v.shape) for k, v in layer_map.tower(model).state_dict().items()}
    other_shapes = source.tower_shapes(model)
    missing = sorted(set(mine) - set(other_shapes))
    if missing:
        raise ValueError(f"`{argument}` lacks parameters of the merged model's tower: {missing[:5]}.")
    wrong = [k for k in mine if mine[k] != other_shapes[k]]
    if wrong:
        k = wrong[0]
        raise ValueError(
            f"`{argument}` has parameter shapes that differ from the merged model: {k} is "
            f"{other_shapes[k]} vs {mine[k]} (and {len(wrong) - 1} more)."
        )


def check_batches_enter_model(
    ctx: RunContext, batches: Mapping[str, list[Batch]], keep: Callable[[int], bool] = lambda index: True
) -> TaskStreams:
    """Every batch of every task, before any block is touched: the keys the layer map needs, tensors
    (not arrays or lists) of consistent batch size, integer token ids inside the vocabulary, a
    forward through the merged model's input path, and at least one weighted token per task.

    Returns what that forward gives, the student stream entering the first stack (parked), of the
    batches whose index `keep` accepts (this process's shard): `enter_stack` takes it as it is."""
    lm, model = ctx.layer_map, ctx.model
    entered: TaskStreams = {}
    tower = ctx.tower
    device = ctx.input_device(tower)
    vocabulary = _vocabulary_size(model)
    with eval_mode(model), torch.no_grad(), patch_products(tower):
        for task, task_batches in batches.items():
            weighted = 0.0
            entered[task] = []
            for index, batch in enumerate(task_batches):
                where = f"calibration_data[{task!r}] batch {index}"
                try:
                    lm.check_batch(model, batch)
                    _check_batch_tensors(batch, lm, model, vocabulary)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from None
                try:
                    state = lm.enter_stack(tower, send_to_device(batch, device), 0, None)
                except Exception as err:
                    raise ValueError(
                        f"calibration_data[{task!r}]: the merged model cannot take its batches (batch {index}, "
                        f"keys {sorted(batch)}): {type(err).__name__}: {err}"
                    ) from err
                if state.weights is not None:
                    weighted += float(state.weights.sum())
                if keep(index):
                    entered[task].append(ctx.park(state))
            if weighted <= 0:
                raise ValueError(
                    f"calibration_data[{task!r}] has no weighted token: every position is padding (attention_mask 0) "
                    "or excluded (labels -100 / loss_mask 0), so there is nothing to calibrate on."
                )
    return entered


_TOKEN_KEYS = ("input_ids", "decoder_input_ids")
_MASK_KEYS = ("attention_mask", "token_type_ids", "decoder_attention_mask", "loss_mask", "labels")


def _vocabulary_size(model: nn.Module) -> int | None:
    """The number of rows of the model's input token embedding (None for models without one)."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def _check_batch_tensors(batch: Mapping[str, Any], layer_map: LayerMap, model: nn.Module,
                         vocabulary: int | None) -> None:
    """Cheap checks of one batch's model inputs (ValueError naming the key): tensors, one batch size,
    integer token ids in [0, vocabulary), labels -100 or token ids where the model reads them as targets."""
    main = layer_map.main_input_name
    size = batch_size_of(batch, main)
    keys = dict.fromkeys((*layer_map.input_names, *_TOKEN_KEYS, *_MASK_KEYS))
    for key in keys:
        if key not in batch or batch[key] is None or isinstance(batch[key], bool):
            continue
        value = batch[key]
        if not isinstance(value, Tensor):
            raise ValueError(
                f"{key!r} is a {type(value).__module__}.{type(value).__qualname__}, expected a torch.Tensor "
                "(convert it with torch.as_tensor)"
            )
        if value.dim() == 0 or value.shape[0] != size:
            raise ValueError(f"{key!r} has shape {tuple(value.shape)}, but {main!r} holds {size} examples")
    if main in _TOKEN_KEYS:
        for key in ("attention_mask", "token_type_ids"):
            mask = batch.get(key)  # a 2-D mask is per token (other ranks are custom attention masks)
            if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape != batch[main].shape:
                raise ValueError(f"{key!r} has shape {tuple(batch[key].shape)}, expected {main!r}'s "
                                 f"{tuple(batch[main].shape)}")
    targets = "labels" in layer_map.required_batch_keys(model)  # labels are token ids (teacher forcing)
    for key in (*_TOKEN_KEYS, *(("labels",) if targets else ())):
        value = batch.get(key)
        if not isinstance(value, Tensor):
            continue
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{key!r} must hold integer token ids, got dtype {value.dtype}")
        ids = value[value != -100] if key == "labels" else value
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"{key!r} holds the negative token id {int(ids.min())}"
                             + (" (only -100 marks ignored labels)" if key == "labels" else ""))
        if vocabulary is not None and ids.numel() and int(ids.max()) >= vocabulary:
            raise ValueError(f"{key!r} holds the token id {int(ids.max())}, outside the model's vocabulary of "
                             f"{vocabulary}")
    if main == "pixel_values" and isinstance(batch.get(main), Tensor) and not batch[main].is_floating_point():
        raise ValueError(f"'pixel_values' must be floating point, got dtype {batch[main].dtype}")


def check_forward_dtype(config: Any, models: Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]]) -> None:
    """Fast mode's `forward_dtype` against the dtypes of the models whose blocks run under it
    (argument → model): autocast to bfloat16 over float16 weights (or to float16 over bfloat16 ones)
    mixes two half-precision dtypes, which torch refuses at the first block; a ValueError naming
    `forward_dtype` and the model's argument instead, before anything runs. float32 / float64 models
    take either dtype."""
    if config.forward_dtype is None:
        return
    wanted = getattr(torch, config.forward_dtype)
    halves = (torch.float16, torch.bfloat16)
    for argument, model in models.items() if isinstance(models, Mapping) else models:
        other = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                        if p.dtype in halves and p.dtype != wanted})
        if other:
            raise ValueError(
                f"FeatCalConfig.forward_dtype={config.forward_dtype!r} cannot run `{argument}`, whose weights are "
                f"{' and '.join(other)}: autocast would mix {other[0]} weights with {config.forward_dtype} "
                "activations. "
                f"Set forward_dtype={other[0]!r} (or None, exact mode), or load the model in float32."
            )
