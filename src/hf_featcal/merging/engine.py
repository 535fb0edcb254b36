"""The engine the task-vector merge methods share (`hf_featcal.merging.methods`): it opens the base and
the experts, lines their keys up, and runs the per-tensor loop a method gives its rule to; plus the
TIES sign election and the exact k-th largest magnitude (radix select) that several methods use.

With task vectors ``tau_i = theta_i - theta_0`` (computed in float32 per floating-point state-dict
tensor, the result cast back to the base tensor's dtype), `merge_task_vectors` writes
``theta = theta_0 + scaling_factor * delta(key, [tau_i])`` into a new model; the base model and the
experts are never modified.

Inputs.  The base and each expert may be an in-memory model or a local folder / hub id.  A base
given by path is loaded with its checkpoint's class (``hf_featcal.model_io.load_model``) and merged
in place (it is ours), an in-memory base is deep-copied.  Experts given by path are read lazily
with ``safetensors.safe_open``, one tensor at a time (sharded checkpoints via
``model.safetensors.index.json``), so memory stays near one model (the result, plus the caller's
base when it was handed over in memory) however many experts there are; checkpoints without
safetensors weights are loaded whole as a fallback.

Mixed architectures are supported when the experts' keys map into the base's under a key prefix,
e.g. a ``CLIPModel`` base (``vision_model.encoder....``) with ``CLIPVisionModel`` experts
(``encoder....``): only the part of the base the experts cover (the vision tower) is merged.  Keys
an expert has under an extra leading prefix (``CLIPVisionModel`` checkpoints saved by
transformers 4.x: ``vision_model.encoder....``) are matched too; the prefix is found per expert
by matching key sets.  Tensors that share storage in the base (tied weights) are merged once.

The merge is recorded on the result as ``merged.config.hf_featcal_merge`` (a JSON-serialisable
dict that survives ``save_pretrained``/``from_pretrained``)::

    {"method": "task_arithmetic", "scaling_factor": 0.3, "experts": ["task_a", "task_b"]}
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..architectures import model_config
from ..experts import InMemorySource, make_source
from ..model_io import (
    AdapterExpert,
    LazyTensors,
    LoraAdapter,
    ModelLike,
    family_layer_map,
    load_model,
    match_keys,
    resolve_checkpoint,
)
from ..pipeline.checks import check_compatible, check_same_function
from ..progress import progress_bar
from .params import MERGE_CONFIG_ATTRIBUTE

__all__ = [
    "DeltaFn",
    "Expert",
    "PrepareFn",
    "canonical_keys",
    "elect_and_merge",
    "float_state",
    "kth_largest_magnitude",
    "merge_record",
    "merge_task_vectors",
    "open_expert",
    "record_merge",
    "sum_delta",
    "sum_tensors",
    "validate_base",
    "validate_experts",
]


def float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Floating-point entries of ``module.state_dict()`` (integer buffers are never merged)."""
    return {k: v for k, v in module.state_dict().items() if torch.is_floating_point(v)}


# ----------------------------------------------------------------------------------------- validation
def validate_experts(experts: Mapping[str, ModelLike]) -> None:
    if not isinstance(experts, Mapping):
        raise ValueError(
            f"`experts` must be a mapping task name -> model (or local folder / hub id), got {type(experts).__name__}"
        )
    if len(experts) == 0:
        raise ValueError("`experts` must contain at least one expert model, got an empty mapping")
    for name, expert in experts.items():
        if not isinstance(name, str):
            raise ValueError(f"`experts` keys must be task names (str), got {name!r}")
        if not isinstance(expert, (nn.Module, str, os.PathLike)):
            raise ValueError(
                f"`experts[{name!r}]` must be a torch.nn.Module / PreTrainedModel, a local folder or a hub id, "
                f"got {type(expert).__name__}"
            )


# ----------------------------------------------------------------------------------------- sources
class Expert:
    """One expert's floating-point tensors, addressed by (canonical) base key."""

    def __init__(
        self, name: str, keys: dict[str, str], fetch: Callable[[str], torch.Tensor], size: int | None = None,
        who: str | None = None,
    ) -> None:
        self.name = name
        self.who = who or f"expert {name!r}"  # how errors name the source
        self.keys = keys  # canonical base key -> the expert's own key
        self._fetch = fetch
        # entries of the expert's whole task vector, when it covers fewer keys than its model has
        # (a LoRA adapter: zeros outside the adapted weights); None = the covered entries
        self.size = size

    def read(self, base_key: str) -> torch.Tensor:
        """The expert's own tensor for ``base_key`` (its dtype and device); refuses non-finite values
        (NaN/Inf would pass silently into the merge)."""
        value = self._fetch(self.keys[base_key]).detach()
        if not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"{self.who} has non-finite values (NaN/Inf) in {self.keys[base_key]!r}; refusing to merge."
            )
        return value

    def task_vector(self, base_key: str, base32: torch.Tensor) -> torch.Tensor:
        """``theta_i - theta_0`` for ``base_key`` in float32 on the base tensor's device; refuses
        non-finite values of the expert or the base."""
        if not bool(torch.isfinite(base32).all()):
            raise ValueError(f"`base_model` has non-finite values (NaN/Inf) in {base_key!r}; refusing to merge.")
        return self.read(base_key).to(device=base32.device, dtype=torch.float32) - base32


def _open_lora_expert(
    name: str, adapter: LoraAdapter, merged: nn.Module, base_state: dict[str, torch.Tensor], canonical: dict[str, str],
    base: Expert | None,
) -> Expert:
    """A LoRA expert covers the tensors `AdapterExpert` (the one adapter reader) says it changes: the
    weights it adapts (the run's base + its delta) and the biases it trained. The base weights are
    `base`'s (a post-merging step's `base_model`), else `base_state`'s as they are now (a merge, whose
    result starts as the base: snapshotted, since the merge then overwrites it)."""
    # the adapter names modules relative to the model class it was trained on (e.g. a CLIPVisionModel
    # inside a CLIPModel base, or a *ForCausalLM around a *Model base): the reader places them
    reader = AdapterExpert(adapter, merged, family_layer_map(merged))
    missing = [key for key in reader.tensors if key not in base_state]
    if missing:
        raise ValueError(f"expert {name!r}: the LoRA adapter adapts modules the base model lacks: {missing[:3]}")
    weights = [key for key, (_, kind) in reader.tensors.items() if kind == "weight"]
    base_weight: Callable[[str], torch.Tensor]
    if base is None:
        base_weight = {key: base_state[key].detach().clone() for key in weights}.__getitem__
    else:
        unread = [key for key in weights if canonical[key] not in base.keys]
        if unread:
            raise ValueError(f"expert {name!r}: the LoRA adapter adapts {unread[:3]}, which {base.who} lacks")
        base_reader = base

        def base_weight(key: str) -> torch.Tensor:
            return base_reader.read(canonical[key])
    keys = {canonical[key]: key for key in reader.tensors}

    def fetch(key: str) -> torch.Tensor:
        return reader.value(key, base_weight(key) if key in weights else None)

    inside = reader.root + "." if reader.root else ""
    model_keys = {canonical[k] for k in base_state if k.startswith(inside)}  # the model the adapter adapts
    return Expert(name, keys, fetch, size=sum(base_state[k].numel() for k in model_keys))


def open_expert(
    name: str,
    source: ModelLike,
    merged: nn.Module,
    base_state: dict[str, torch.Tensor],
    canonical: dict[str, str],
    base_label: str,
    stack: contextlib.ExitStack,
    argument: str | None = None,
    base: Expert | None = None,
) -> Expert:
    """Match an expert's keys and shapes to the base's; tensors of a checkpoint are read lazily.  When
    the library knows the base's family, the expert must also pass the calibrator's compatibility
    check (`hf_featcal.pipeline.checks.check_compatible`: model type, the configuration's geometry
    such as layer and head counts and activation, the tower's shapes), so that a merge FeatCal would
    refuse is refused here, before any tensor is merged; without a layer map, the configuration
    check alone (`hf_featcal.pipeline.checks.check_same_function`: every field that changes the
    function).  (A LoRA adapter is the base plus deltas:
    it has the base's configuration by construction.)  ``argument`` names the source in errors
    (default ``experts[name]``; a post-merging step opens the base model this way too).

    The run's base decides what an adapter is: its weights are ``base``'s (the reader of the base
    model a post-merging step was given) plus the adapter's delta, never ``merged``'s, which after a
    merge are not the base's; without ``base`` (a merge, whose ``merged`` is still the base when its
    experts are opened) ``base_state``'s values at opening."""
    who = argument or f"expert {name!r}"
    argument = argument or f"experts[{name!r}]"
    checkpoint = None if isinstance(source, nn.Module) else resolve_checkpoint(source, argument)
    if checkpoint is not None and checkpoint.adapter is not None:
        return _open_lora_expert(name, LoraAdapter(checkpoint.adapter, argument), merged, base_state, canonical,
                                 base)
    layer_map = family_layer_map(merged)
    fetch: Callable[[str], torch.Tensor]
    if checkpoint is not None and checkpoint.lazy:
        assert not isinstance(source, nn.Module)  # only a path or hub id resolves to a checkpoint
        if layer_map is not None:  # the calibrator's check, on the config and shapes alone
            check_compatible(make_source(source, argument, layer_map), layer_map, merged, model_config(merged))
        elif checkpoint.folder is not None and os.path.isfile(os.path.join(checkpoint.folder, "config.json")):
            from transformers import AutoConfig

            check_same_function(argument, model_config(merged),
                                AutoConfig.from_pretrained(checkpoint.folder, trust_remote_code=False), "base")
        # the files stay open until the merge ends
        tensors = stack.enter_context(LazyTensors(checkpoint.files, argument, checkpoint.stored))
        shapes = {key: tensors.shape(key) for key in tensors.keys() if tensors.is_floating(key)}
        fetch = tensors.read
        label = f"checkpoint {os.fspath(source)!r}"
    else:
        model = source if isinstance(source, nn.Module) else load_model(source, argument)
        if layer_map is not None:
            check_compatible(InMemorySource(model, argument, layer_map), layer_map, merged, model_config(merged))
        else:  # no layer map: the configuration alone
            check_same_function(argument, model_config(merged), model_config(model), "base")
        state = float_state(model)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        fetch = state.__getitem__
        label = type(model).__name__

    mapping = match_keys(set(base_state), shapes)
    if mapping is None:
        missing = sorted(k for k in shapes if k not in base_state)[:5]
        raise ValueError(
            f"{who} ({label}) does not line up with {base_label}: no key prefix maps all of its state-dict "
            f"keys into that state dict (e.g. unmatched keys: {missing})"
        )
    for key, base_key in mapping.items():
        if tuple(base_state[base_key].shape) != shapes[key]:
            raise ValueError(
                f"{who}: shape of {key!r} {shapes[key]} does not match {base_key!r} "
                f"{tuple(base_state[base_key].shape)} of {base_label}"
            )
    by_base = {base_key: key for key, base_key in mapping.items()}
    keys: dict[str, str] = {}
    for base_key in base_state:  # base state-dict order; tied base keys collapse onto one
        if base_key in by_base:
            keys.setdefault(canonical[base_key], by_base[base_key])
    return Expert(name, keys, fetch, who=who)


def canonical_keys(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Key -> the first key (in state-dict order) whose tensor shares its storage (tied weights)."""
    seen: dict[tuple, str] = {}
    canonical: dict[str, str] = {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr() if value.numel() else 0
        if ptr == 0:  # meta / empty tensors: never treated as tied
            canonical[key] = key
            continue
        ident = (value.device, ptr, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
        canonical[key] = seen.setdefault(ident, key)
    return canonical


def validate_base(base_model: object) -> None:
    if not isinstance(base_model, (nn.Module, str, os.PathLike)):
        raise ValueError(
            "`base_model` must be a torch.nn.Module / PreTrainedModel, a local folder or a hub id, "
            f"got {type(base_model).__name__}"
        )


def _load_base(base_model: ModelLike) -> nn.Module:
    """The model to write the merge into: a deep copy of an in-memory base, or the base loaded from
    its folder / hub id with its checkpoint's class (ours, so merged in place)."""
    validate_base(base_model)
    if isinstance(base_model, nn.Module):
        return copy.deepcopy(base_model)
    return load_model(base_model, "base_model")


# ----------------------------------------------------------------------------------------- the per-tensor loop
#: delta(key, [(expert, tau_i) for the experts covering key]) -> merged task vector (float32)
DeltaFn = Callable[[str, list[tuple[Expert, torch.Tensor]]], torch.Tensor]
#: prepare(experts, base_state) runs before the merge pass (e.g. TIES thresholds)
PrepareFn = Callable[[list[Expert], dict[str, torch.Tensor]], None]


def merge_task_vectors(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    method: str,
    params: Mapping[str, Any],
    delta_fn: DeltaFn,
    *,
    scaling_factor: float,
    prepare: PrepareFn | None = None,
) -> nn.Module:
    """``theta = theta_0 + scaling_factor * delta_fn(key, task vectors)`` for every (canonical)
    floating-point base key at least one expert covers, one key at a time; other keys keep the base
    weights.  Task vectors of an expert that lacks a key are absent from that key's list.  A
    non-finite value in an input is refused when its tensor is first read (naming the expert or the
    base and the tensor), a non-finite result before it is written (naming ``scaling_factor``); the
    result is the function's own copy, so the caller's models stay as they were.  A progress bar counts
    the tensors (`hf_featcal.progress`: hidden by transformers' ``disable_progress_bar()``).  The result records
    ``{"method": method, **params, "experts": [...]}`` (`record_merge`)."""
    validate_base(base_model)
    validate_experts(experts)
    record = {"method": method, **params, "experts": [str(k) for k in experts]}
    merged = _load_base(base_model)
    state = float_state(merged)  # shares storage with the result's parameters / buffers
    canonical = canonical_keys(state)
    with contextlib.ExitStack() as stack:
        readers = [
            open_expert(name, source, merged, state, canonical, f"the base model ({type(merged).__name__})", stack)
            for name, source in experts.items()
        ]
        with torch.no_grad():
            if prepare is not None:
                prepare(readers, state)
            covered = [key for key in dict.fromkeys(canonical.values()) if any(key in r.keys for r in readers)]
            bar = stack.enter_context(progress_bar(covered, desc=f"Merging ({method})", unit="tensor"))
            for key in bar:
                covering = [r for r in readers if key in r.keys]
                target = state[key]
                base32 = target.detach().float()
                delta = delta_fn(key, [(r, r.task_vector(key, base32)) for r in covering])
                value = (base32 + scaling_factor * delta).to(target.dtype)
                # the inputs are finite (task_vector): the parameters overflow
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(
                        f"the merge is not finite (NaN/Inf) in {key!r} with `scaling_factor`={scaling_factor!r} "
                        f"({target.dtype}); refusing it: use a smaller `scaling_factor` (the base model and the "
                        "experts are unchanged)."
                    )
                target.copy_(value)

    record_merge(merged, record)
    return merged


def _record_holder(model: nn.Module) -> Any:
    """Where a model's merge record lives: its config (saved in config.json); a model without one
    (open_clip) keeps it as an attribute."""
    config = getattr(model, "config", None)
    return model if config is None else config


def record_merge(model: nn.Module, record: dict) -> None:
    """Record how `model` was merged (`merge_record` reads it back)."""
    setattr(_record_holder(model), MERGE_CONFIG_ATTRIBUTE, record)


def merge_record(model: nn.Module) -> dict | None:
    """How `model` was merged, as `record_merge` recorded it (None for a model without a record)."""
    record = getattr(_record_holder(model), MERGE_CONFIG_ATTRIBUTE, None)
    return dict(record) if isinstance(record, Mapping) else None


def sum_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``t_1 + t_2 + ...``, added left to right (the order FusionBench's merges add task vectors in)."""
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def sum_delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
    return sum_tensors([tau for _, tau in task_vectors])


# ----------------------------------------------------------------------------------------- shared rules
def elect_and_merge(stacked: torch.Tensor, merge_func: str) -> torch.Tensor:
    """TIES steps 2-3 on ``stacked`` (experts along dim 0): sign of the sum per entry (a zero sum
    elects ``+``), then the mean (or sum) of the nonzero entries of that sign."""
    # PEFT's merge utilities (lazy import): the same sign election and disjoint mean
    from peft.utils.merge_utils import calculate_majority_sign_mask, disjoint_merge

    agree = calculate_majority_sign_mask(stacked, method="total")
    if merge_func == "mean":
        return disjoint_merge(stacked, agree)
    return (stacked * agree).sum(dim=0)


_HIGH_BINS = 1 << 15  # bit patterns of non-negative float32 values are < 2**31: top 16 bits < 2**15
_LOW_BINS = 1 << 16


def _select_bin(hist: torch.Tensor, rank: int) -> tuple[int, int]:
    """The bin holding the ``rank``-th largest element (1-based) and that element's rank in the bin."""
    from_top = hist.flip(0).cumsum(0)
    position = int(torch.searchsorted(from_top, torch.tensor([rank], dtype=from_top.dtype))[0])
    index = hist.numel() - 1 - position
    above = int(from_top[position]) - int(hist[index])
    return index, rank - above


def kth_largest_magnitude(magnitudes: Callable[[], Iterator[torch.Tensor]], k: int) -> float:
    """Exact ``k``-th largest value over all tensors ``magnitudes()`` yields (non-negative float32),
    without concatenating them: a two-level radix select on the float32 bit patterns (which order
    like the values for non-negative floats).  Pass 1 histograms the top 16 bits of every entry,
    pass 2 the low 16 bits of the entries in the selected top bin; memory is one tensor plus two
    small histograms.  ``k <= 0`` gives ``inf`` (nothing is kept)."""
    if k <= 0:
        return math.inf

    def bit_patterns() -> Iterator[torch.Tensor]:
        for values in magnitudes():
            yield values.detach().to(torch.float32).contiguous().view(-1).view(torch.int32)

    high_hist = torch.zeros(_HIGH_BINS, dtype=torch.int64)
    for bits in bit_patterns():
        high_hist += torch.bincount((bits >> 16).long(), minlength=_HIGH_BINS).cpu()
    if int(high_hist.sum()) < k:
        raise ValueError(f"cannot take the {k}-th largest of {int(high_hist.sum())} values")
    high, rank = _select_bin(high_hist, k)
    low_hist = torch.zeros(_LOW_BINS, dtype=torch.int64)
    for bits in bit_patterns():
        low_bits = bits[(bits >> 16) == high] & 0xFFFF
        low_hist += torch.bincount(low_bits.long(), minlength=_LOW_BINS).cpu()
    low, _ = _select_bin(low_hist, rank)
    return torch.tensor([(high << 16) | low], dtype=torch.int32).view(torch.float32).item()
