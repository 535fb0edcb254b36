"""Weight-space merging of task experts: Task Arithmetic, simple averaging, TIES-Merging, DARE, DARE-TIES.

Every function returns a *new* model; the base model and the experts are never modified.  With
task vectors ``tau_i = theta_i - theta_0`` (computed in float32 per floating-point state-dict
tensor, the result cast back to the base tensor's dtype):

* ``task_arithmetic``: ``theta = theta_0 + lambda * sum_i tau_i``;
* ``simple_average``: Task Arithmetic with ``lambda = 1 / n`` (the mean of the experts);
* ``ties_merging`` (Yadav et al. 2023): trim each ``tau_i`` to its top-``density`` entries by
  magnitude (over the whole task vector, or per tensor), elect a sign per entry (sign of the sum of
  the trimmed vectors), average the entries that agree with it ("disjoint mean"), then
  ``theta = theta_0 + lambda * merged``;
* ``dare_merging`` (Yu et al. 2023): drop each entry of ``tau_i`` with probability ``p`` (seeded,
  reproducible), rescale the rest by ``1 / (1 - p)`` (or, ``rescale_mode="l1"``, so that each
  tensor keeps its L1 norm, as mergekit), then Task Arithmetic;
* ``dare_ties_merging``: the DARE drop and rescale, then TIES' sign election and disjoint merge;
* ``merge_models``: one entry point naming the method by string.

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
import hashlib
import inspect
import math
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from .architectures import model_config
from .experts import InMemorySource, make_source
from .pipeline.checks import check_compatible
from .schema import merge_parameters
from .model_io import (
    LazyTensors,
    LoraAdapter,
    ModelLike,
    family_layer_map,
    find_key_prefix,
    load_model,
    lora_module_paths,
    match_keys,
    resolve_checkpoint,
)

__all__ = [
    "task_arithmetic",
    "simple_average",
    "ties_merging",
    "dare_merging",
    "dare_ties_merging",
    "merge_models",
    "find_key_prefix",
    "MERGE_CONFIG_ATTRIBUTE",
    "MERGE_METHODS",
]

#: Name of the config attribute that records how a model was merged.
MERGE_CONFIG_ATTRIBUTE = "hf_featcal_merge"

def _float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Floating-point entries of ``module.state_dict()`` (integer buffers are never merged)."""
    return {k: v for k, v in module.state_dict().items() if torch.is_floating_point(v)}


# ----------------------------------------------------------------------------------------- validation
def _checked(method: str, **values: object) -> tuple:
    """``values`` checked and normalised by ``method``'s declarations in `hf_featcal.schema`
    (the same ones recipes and the CLI use), in the order given; ValueError naming the argument."""
    declared = merge_parameters(method)
    out = []
    for name, value in values.items():
        try:
            out.append(declared[name].check(value))
        except ValueError as err:
            raise ValueError(f"`{name}` {err}") from None
    return tuple(out)


def _check_declarations() -> None:
    """The declarations of `hf_featcal.schema` name exactly each merge function's parameters, with
    its defaults (a drift between the two is a programming error, caught at import)."""
    for method, function in MERGE_METHODS.items():
        signature = inspect.signature(function).parameters
        from_signature = {n: p.default for n, p in signature.items() if n not in ("base_model", "experts")}
        from_declarations = {n: p.default for n, p in merge_parameters(method).items()}
        if from_signature != from_declarations:
            raise RuntimeError(
                f"merge method {method!r}: {function.__name__}'s parameters {from_signature} differ from "
                f"hf_featcal.schema's declarations {from_declarations}"
            )


def _validate_experts(experts: Mapping[str, ModelLike]) -> None:
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
class _Expert:
    """One expert's floating-point tensors, addressed by (canonical) base key."""

    def __init__(
        self, name: str, keys: dict[str, str], fetch: Callable[[str], torch.Tensor], size: int | None = None
    ) -> None:
        self.name = name
        self.keys = keys  # canonical base key -> the expert's own key
        self._fetch = fetch
        # entries of the expert's whole task vector, when it covers fewer keys than its model has
        # (a LoRA adapter: zeros outside the adapted weights); None = the covered entries
        self.size = size

    def task_vector(self, base_key: str, base32: torch.Tensor) -> torch.Tensor:
        """``theta_i - theta_0`` for ``base_key`` in float32 on the base tensor's device; refuses
        non-finite values of the expert or the base (NaN/Inf would pass silently into the merge)."""
        if not bool(torch.isfinite(base32).all()):
            raise ValueError(f"`base_model` has non-finite values (NaN/Inf) in {base_key!r}; refusing to merge.")
        value = self._fetch(self.keys[base_key]).detach()
        if not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"expert {self.name!r} has non-finite values (NaN/Inf) in {self.keys[base_key]!r}; refusing to merge."
            )
        return value.to(device=base32.device, dtype=torch.float32) - base32


def _open_lora_expert(
    name: str, adapter: LoraAdapter, merged: nn.Module, base_state: dict[str, torch.Tensor], canonical: dict[str, str]
) -> _Expert:
    """A LoRA expert covers the weights it adapts (base + its delta) and the biases it trained
    (``bias="all"`` / ``"lora_only"``: the stored bias replaces the base's, as PEFT applies it)."""
    # the adapter names modules relative to the model class it was trained on (e.g. a CLIPVisionModel
    # inside a CLIPModel base, or a *ForCausalLM around a *Model base): model_io places them
    root, paths = lora_module_paths(adapter, merged, family_layer_map(merged))
    # the adapter's own tensor name (its module + ".weight" / ".bias") -> the base state-dict key
    by_tensor = {f"{module}.weight": paths[module] + ".weight" for module in adapter.modules}
    by_tensor.update({f"{module}.bias": paths[module] + ".bias" for module in adapter.biases})
    missing = [t for t, key in by_tensor.items() if key not in base_state]
    if missing:
        raise ValueError(f"expert {name!r}: the LoRA adapter adapts modules the base model lacks: {missing[:3]}")
    original = {by_tensor[f"{m}.weight"]: base_state[by_tensor[f"{m}.weight"]].detach().clone() for m in adapter.modules}
    keys = {canonical[key]: tensor for tensor, key in by_tensor.items()}

    def fetch(tensor: str) -> torch.Tensor:
        module, _, kind = tensor.rpartition(".")
        if kind == "bias":
            return adapter.bias(module)
        base = original[by_tensor[tensor]]  # base weight + (B·A)·scaling
        return base.float() + adapter.delta(module).to(base.device)

    inside = root + "." if root else ""
    model_keys = {canonical[k] for k in base_state if k.startswith(inside)}  # the model the adapter adapts
    return _Expert(name, keys, fetch, size=sum(base_state[k].numel() for k in model_keys))


def _open_expert(
    name: str,
    source: ModelLike,
    merged: nn.Module,
    base_state: dict[str, torch.Tensor],
    canonical: dict[str, str],
    base_label: str,
    stack: contextlib.ExitStack,
) -> _Expert:
    """Match an expert's keys and shapes to the base's; tensors of a checkpoint are read lazily.  When
    the library knows the base's family, the expert must also pass the calibrator's compatibility
    check (`hf_featcal.pipeline.checks.check_compatible`: model type, the configuration's geometry
    such as layer and head counts and activation, the tower's shapes), so that a merge FeatCal would
    refuse is refused here, before any tensor is merged.  (A LoRA adapter is the base plus deltas:
    it has the base's configuration by construction.)"""
    argument = f"experts[{name!r}]"
    checkpoint = None if isinstance(source, nn.Module) else resolve_checkpoint(source, argument)
    if checkpoint is not None and checkpoint.adapter is not None:
        return _open_lora_expert(name, LoraAdapter(checkpoint.adapter, argument), merged, base_state, canonical)
    layer_map = family_layer_map(merged)
    if checkpoint is not None and checkpoint.lazy:
        if layer_map is not None:  # the calibrator's check, on the config and shapes alone
            check_compatible(make_source(source, argument, layer_map), layer_map, merged, model_config(merged))
        tensors = stack.enter_context(LazyTensors(checkpoint.files, argument))  # files open until the merge ends
        shapes = {key: tensors.shape(key) for key in tensors.keys() if tensors.is_floating(key)}
        fetch = tensors.read
        label = f"checkpoint {os.fspath(source)!r}"
    else:
        model = source if isinstance(source, nn.Module) else load_model(source, argument)
        if layer_map is not None:
            check_compatible(InMemorySource(model, argument, layer_map), layer_map, merged, model_config(merged))
        state = _float_state(model)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        fetch = state.__getitem__
        label = type(model).__name__

    mapping = match_keys(set(base_state), shapes)
    if mapping is None:
        missing = sorted(k for k in shapes if k not in base_state)[:5]
        raise ValueError(
            f"expert {name!r} ({label}) does not line up with the base model ({base_label}): no key prefix maps "
            f"all of its state-dict keys into the base state dict (e.g. unmatched expert keys: {missing})"
        )
    for key, base_key in mapping.items():
        if tuple(base_state[base_key].shape) != shapes[key]:
            raise ValueError(
                f"expert {name!r}: shape of {key!r} {shapes[key]} does not match the base model's "
                f"{base_key!r} {tuple(base_state[base_key].shape)}"
            )
    by_base = {base_key: key for key, base_key in mapping.items()}
    keys: dict[str, str] = {}
    for base_key in base_state:  # base state-dict order; tied base keys collapse onto one
        if base_key in by_base:
            keys.setdefault(canonical[base_key], by_base[base_key])
    return _Expert(name, keys, fetch)


def _canonical_keys(state: dict[str, torch.Tensor]) -> dict[str, str]:
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


def _validate_base(base_model: object) -> None:
    if not isinstance(base_model, (nn.Module, str, os.PathLike)):
        raise ValueError(
            "`base_model` must be a torch.nn.Module / PreTrainedModel, a local folder or a hub id, "
            f"got {type(base_model).__name__}"
        )


def _load_base(base_model: ModelLike) -> nn.Module:
    """The model to write the merge into: a deep copy of an in-memory base, or the base loaded from
    its folder / hub id with its checkpoint's class (ours, so merged in place)."""
    _validate_base(base_model)
    if isinstance(base_model, nn.Module):
        return copy.deepcopy(base_model)
    return load_model(base_model, "base_model")


# ----------------------------------------------------------------------------------------- engine
#: delta(key, [(expert, tau_i) for the experts covering key]) -> merged task vector (float32)
_DeltaFn = Callable[[str, list[tuple[_Expert, torch.Tensor]]], torch.Tensor]
#: prepare(experts, base_state) runs before the merge pass (e.g. TIES thresholds)
_PrepareFn = Callable[[list[_Expert], dict[str, torch.Tensor]], None]


def _merge(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float,
    record: dict,
    delta_fn: _DeltaFn,
    prepare: _PrepareFn | None = None,
) -> nn.Module:
    """``theta = theta_0 + scaling_factor * delta_fn(key, task vectors)`` for every (canonical)
    floating-point base key at least one expert covers, one key at a time; other keys keep the base
    weights.  Task vectors of an expert that lacks a key are absent from that key's list.  A
    non-finite value in an input is refused when its tensor is first read (naming the expert or the
    base and the tensor), a non-finite result before it is written (naming ``scaling_factor``); the
    result is the function's own copy, so the caller's models stay as they were."""
    _validate_base(base_model)
    _validate_experts(experts)
    merged = _load_base(base_model)
    state = _float_state(merged)  # shares storage with the result's parameters / buffers
    canonical = _canonical_keys(state)
    with contextlib.ExitStack() as stack:
        readers = [
            _open_expert(name, source, merged, state, canonical, type(merged).__name__, stack)
            for name, source in experts.items()
        ]
        with torch.no_grad():
            if prepare is not None:
                prepare(readers, state)
            for key in dict.fromkeys(canonical.values()):
                covering = [r for r in readers if key in r.keys]
                if not covering:
                    continue
                target = state[key]
                base32 = target.detach().float()
                delta = delta_fn(key, [(r, r.task_vector(key, base32)) for r in covering])
                value = (base32 + scaling_factor * delta).to(target.dtype)
                if not bool(torch.isfinite(value).all()):  # the inputs are finite (task_vector): the parameters overflow
                    raise ValueError(
                        f"the merge is not finite (NaN/Inf) in {key!r} with `scaling_factor`={scaling_factor!r} "
                        f"({target.dtype}); refusing it: use a smaller `scaling_factor` (the base model and the "
                        "experts are unchanged)."
                    )
                target.copy_(value)

    # on the config (saved in config.json); a model without one (open_clip) keeps it as an attribute
    config = getattr(merged, "config", None)
    setattr(merged if config is None else config, MERGE_CONFIG_ATTRIBUTE, record)
    return merged


def _sum_delta(key: str, task_vectors: list[tuple[_Expert, torch.Tensor]]) -> torch.Tensor:
    delta = task_vectors[0][1]
    for _, tau in task_vectors[1:]:
        delta = delta + tau
    return delta


def _names(experts: Mapping[str, ModelLike]) -> list[str]:
    return [str(k) for k in experts]


# ----------------------------------------------------------------------------------------- TIES helpers
def _kept_count(density: float, entries: int) -> int:
    """Entries a magnitude trim keeps: ``int(density * entries)``, but at least one of a non-empty
    tensor / task vector (as mergekit 0.1.5; a small tensor would otherwise lose its update entirely)."""
    return max(1, int(density * entries)) if entries > 0 else 0


def _trim_tensor(tau: torch.Tensor, density: float) -> torch.Tensor:
    """``tau`` with all but its ``_kept_count(density, numel)`` largest-magnitude entries zeroed
    (exactly that many: ``torch.topk`` picks among equal magnitudes at the boundary)."""
    keep = _kept_count(density, tau.numel())
    if keep >= tau.numel():
        return tau
    flat = tau.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[flat.abs().topk(keep).indices] = 1.0
    return (flat * mask).view_as(tau)


def _elect_and_merge(stacked: torch.Tensor, merge_func: str) -> torch.Tensor:
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


def _kth_largest_magnitude(magnitudes: Callable[[], Iterator[torch.Tensor]], k: int) -> float:
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
        low = bits[(bits >> 16) == high] & 0xFFFF
        low_hist += torch.bincount(low.long(), minlength=_LOW_BINS).cpu()
    low, _ = _select_bin(low_hist, rank)
    return torch.tensor([(high << 16) | low], dtype=torch.int32).view(torch.float32).item()


def _global_thresholds(density: float) -> tuple[dict[str, float], _PrepareFn]:
    """A ``prepare`` step computing, per expert, the magnitude threshold that keeps its top
    ``density`` fraction of entries over its whole task vector (all covered tensors together)."""
    thresholds: dict[str, float] = {}

    def prepare(readers: list[_Expert], state: dict[str, torch.Tensor]) -> None:
        for reader in readers:

            def magnitudes(reader: _Expert = reader) -> Iterator[torch.Tensor]:
                for key in reader.keys:
                    yield reader.task_vector(key, state[key].detach().float()).abs_()

            covered = sum(state[key].numel() for key in reader.keys)
            k = _kept_count(density, reader.size if reader.size is not None else covered)
            # beyond the covered entries the task vector is zero: the k-th largest is then 0
            thresholds[reader.name] = 0.0 if k > covered else _kth_largest_magnitude(magnitudes, k)

    return thresholds, prepare


# ----------------------------------------------------------------------------------------- DARE helpers
def _dare_generator(seed: int, expert: str, key: str) -> torch.Generator:
    """The CPU generator for expert ``expert``'s tensor at base key ``key``: seeded with the first 8
    bytes (little-endian, top bit cleared) of ``sha256(f"{seed}:{expert}:{key}")``."""
    digest = hashlib.sha256(f"{seed}:{expert}:{key}".encode("utf-8")).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


#: ``rescale_mode`` values: divide by the keep rate ``1 - p`` (DARE paper, FusionBench), or match
#: each tensor's L1 norm before the drop (mergekit).
DARE_RESCALE_MODES = merge_parameters("dare")["rescale_mode"].choices
#: below this L1 norm (before or after the drop) a tensor is left unscaled, as mergekit (its eps)
_L1_RESCALE_EPS = 1e-7


def _dare_drop(
    drop_rate: float, rescale: bool, rescale_mode: str, seed: int
) -> Callable[[_Expert, str, torch.Tensor], torch.Tensor]:
    """``drop(expert, key, tau)``: the seeded DARE drop of one tensor, then its rescaling."""

    def drop(expert: _Expert, key: str, tau: torch.Tensor) -> torch.Tensor:
        if drop_rate == 0:
            return tau
        keep = torch.rand(tau.shape, generator=_dare_generator(seed, expert.name, key)) >= drop_rate
        dropped = tau * keep.to(tau.device)
        if not rescale:
            return dropped
        if rescale_mode == "keep_rate":
            return dropped / (1.0 - drop_rate)
        before, after = tau.abs().sum(), dropped.abs().sum()
        if before < _L1_RESCALE_EPS or after < _L1_RESCALE_EPS:  # e.g. everything dropped
            return dropped
        return dropped * (before / after)

    return drop


# ----------------------------------------------------------------------------------------- public API
def task_arithmetic(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 0.3,
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with Task Arithmetic.

    ``theta_m = theta_0 + scaling_factor * sum_i (theta_i - theta_0)`` on every floating-point
    state-dict tensor the experts share with the base model.

    Args:
        base_model: The pre-trained model the experts were fine-tuned from (a ``PreTrainedModel``),
            or its local folder / hub id.  It is not modified.
        experts: Mapping task name -> fine-tuned model (or local folder / hub id, read lazily) of the
            same architecture, or of a sub-module of the base (e.g. ``CLIPVisionModel`` experts for a
            ``CLIPModel`` base: only the vision tower is merged).  Not modified.
        scaling_factor: The task-vector scaling ``lambda``, in ``[-100, 100]``.

    Returns:
        A new model holding the merged weights, with
        ``config.hf_featcal_merge = {"method": "task_arithmetic", "scaling_factor": ..., "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping, a ``scaling_factor`` outside its range, a
            source that cannot be loaded, an expert whose configuration, state-dict keys or shapes do not
            line up with the base, non-finite weights, or a non-finite merge.
    """
    (scaling_factor,) = _checked("task_arithmetic", scaling_factor=scaling_factor)
    _validate_base(base_model)
    _validate_experts(experts)
    record = {"method": "task_arithmetic", "scaling_factor": scaling_factor, "experts": _names(experts)}
    return _merge(base_model, experts, scaling_factor, record, _sum_delta)


def simple_average(base_model: ModelLike, experts: Mapping[str, ModelLike]) -> nn.Module:
    """Average the experts' weights: Task Arithmetic with ``scaling_factor = 1 / len(experts)``.

    Equivalent to ``theta_m = mean_i theta_i`` on every shared floating-point tensor; tensors of
    the base that the experts do not cover keep the base weights.  Inputs (models, or local folders /
    hub ids) are not modified.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "simple_average",
        "scaling_factor": 1/n, "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping or mismatched architectures.
    """
    _validate_base(base_model)
    _validate_experts(experts)
    scaling_factor = 1.0 / len(experts)
    record = {"method": "simple_average", "scaling_factor": scaling_factor, "experts": _names(experts)}
    return _merge(base_model, experts, scaling_factor, record, _sum_delta)


def ties_merging(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 0.3,
    density: float = 0.2,
    per_tensor_trim: bool = False,
    *,
    merge_func: str = "mean",
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with TIES-Merging (Yadav et al. 2023).

    With task vectors ``tau_i = theta_i - theta_0`` (float32):

    1. **Trim** each ``tau_i`` by magnitude; ``density >= 1`` keeps everything.

       * ``per_tensor_trim=False`` (default, the paper's global trim): ``d`` is the number of
         entries of expert ``i``'s whole task vector, i.e. of all its floating-point tensors that
         map into the base, taken together, tied tensors counted once (for a LoRA expert: every
         floating-point entry of the model the adapter was trained on, zero outside the adapted
         weights).  With ``k = max(1, int(density * d))`` and ``t`` the exact ``k``-th largest
         ``|tau_i|``, every entry with ``|tau_i| >= t`` is kept: exactly ``k`` entries, or more when
         other entries have magnitude exactly ``t`` (all of them are kept).  ``t`` is found
         without concatenating the task vector (radix select on the float32 bit patterns, two
         passes over the expert).
       * ``per_tensor_trim=True``: each tensor on its own, exactly ``k = max(1, int(density *
         numel))`` entries kept (``torch.topk`` of ``|tau|``, which picks among equal magnitudes at
         the boundary).  A tensor with ``int(density * numel) = 0`` thus keeps its largest entry
         rather than losing its update (PEFT's ``prune(..., "magnitude")`` would keep none).
    2. **Elect sign**: per entry, the sign of ``sum_i trimmed_i``; a zero sum elects ``+`` (as
       ``peft.utils.merge_utils.calculate_majority_sign_mask(..., "total")``).
    3. **Disjoint merge**: per entry, the mean of the trimmed entries whose sign equals the elected
       one (zeros never count); ``merge_func="sum"`` takes their sum instead.
    4. ``theta = theta_0 + scaling_factor * merged``.

    How the peers differ (same ``tau_i``, one weight per expert):

    * mergekit 0.1.5 (``merge_method: ties``) trims per tensor only, with the same count
      ``max(1, int(density * numel))`` and exactly that many entries (ties at the boundary broken
      by its sort, which may pick other entries than ``torch.topk``), the same sign rule and
      disjoint mean (``normalize: true``); ``per_tensor_trim=True`` is the same merge (its
      ``lambda`` defaults to 1).
    * FusionBench 0.2.33 (``TiesMergingAlgorithm``) trims globally, over the flattened state dict
      of all keys (sorted), so tied tensors are counted twice; it keeps ``|tau| >=`` the
      ``(d - int(density * d))``-th smallest magnitude (``kthvalue``), i.e. ``int(density * d) + 1``
      entries per expert, one more than here; ``threshold: 20`` in its config means
      ``density = 0.2``; a zero sign sum takes the sign that wins over the whole vector instead
      of ``+``; its config default is ``merge_func: sum``.

    Experts lacking a tensor of the base (but covering others) contribute nothing to it.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``lambda``, in ``[-100, 100]``.
        density: Fraction of entries kept by the trim, in ``(0, 1]``.
        per_tensor_trim: Trim per tensor instead of over the whole task vector.
        merge_func: ``"mean"`` (disjoint mean, the TIES paper) or ``"sum"``.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "ties", "scaling_factor": ...,
        "density": ..., "per_tensor_trim": ..., "merge_func": ..., "experts": [...]}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    scaling_factor, density, per_tensor_trim, merge_func = _checked(
        "ties", scaling_factor=scaling_factor, density=density, per_tensor_trim=per_tensor_trim, merge_func=merge_func
    )
    _validate_base(base_model)
    _validate_experts(experts)

    prepare: _PrepareFn | None = None
    thresholds: dict[str, float] = {}
    if not per_tensor_trim:
        thresholds, prepare = _global_thresholds(density)

    def trim(expert: _Expert, tau: torch.Tensor) -> torch.Tensor:
        if per_tensor_trim:
            return tau if density >= 1 else _trim_tensor(tau, density)
        return tau * (tau.abs() >= thresholds[expert.name])

    def delta(key: str, task_vectors: list[tuple[_Expert, torch.Tensor]]) -> torch.Tensor:
        return _elect_and_merge(torch.stack([trim(expert, tau) for expert, tau in task_vectors]), merge_func)

    record = {
        "method": "ties",
        "scaling_factor": scaling_factor,
        "density": density,
        "per_tensor_trim": per_tensor_trim,
        "merge_func": merge_func,
        "experts": _names(experts),
    }
    return _merge(base_model, experts, scaling_factor, record, delta, prepare)


_DARE_RANDOMNESS_DOC = """\
    Randomness is reproducible and independent of torch's global RNG (left untouched): the keep
    mask of expert ``name`` for the base state-dict key ``key`` (the merged model's name of the
    tensor) is ``torch.rand(shape, generator=g) >= p`` with a CPU generator ``g`` seeded by the first
    8 bytes (little-endian, top bit cleared) of ``sha256(f"{seed}:{name}:{key}")``.  The result thus
    does not depend on the experts' order, on their device, or on whether they are given as models
    or as folders."""

_DARE_RESCALE_DOC = """\
    Rescaling (``rescale=True``) of a dropped tensor ``m * tau`` (``m`` the keep mask):
    ``rescale_mode="keep_rate"`` (default; the DARE paper, FusionBench) divides it by ``1 - p``;
    ``rescale_mode="l1"`` (mergekit 0.1.5's ``rescale: true``, the default of its ``dare_linear``
    and ``dare_ties``) multiplies it by
    ``||tau||_1 / ||m * tau||_1`` so that the tensor keeps its L1 norm, and leaves it unscaled
    when either norm is below ``1e-7`` (e.g. when everything was dropped), as mergekit."""


def dare_merging(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 0.3,
    drop_rate: float = 0.9,
    rescale: bool = True,
    seed: int = 0,
    *,
    rescale_mode: str = "keep_rate",
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with DARE (Yu et al. 2023) + Task Arithmetic.

    Each entry of each task vector ``tau_i = theta_i - theta_0`` is dropped with probability
    ``p = drop_rate`` (Bernoulli), the kept ones are rescaled when ``rescale``, then
    ``theta = theta_0 + scaling_factor * sum_i dropped_i``.  ``drop_rate=0`` is Task Arithmetic
    exactly.

{rescale}

{randomness}

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``lambda``, in ``[-100, 100]``.
        drop_rate: Drop probability ``p`` in ``[0, 1)``.
        rescale: Rescale the kept entries (the DARE rescaling).
        seed: Integer seed.
        rescale_mode: ``"keep_rate"`` (divide by ``1 - p``) or ``"l1"`` (keep each tensor's L1 norm).

    Returns:
        A new model with ``config.hf_featcal_merge = {{"method": "dare", "scaling_factor": ...,
        "drop_rate": ..., "rescale": ..., "rescale_mode": ..., "seed": ..., "experts": [...]}}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    scaling_factor, drop_rate, rescale, rescale_mode, seed = _checked(
        "dare", scaling_factor=scaling_factor, drop_rate=drop_rate, rescale=rescale, rescale_mode=rescale_mode, seed=seed
    )
    _validate_base(base_model)
    _validate_experts(experts)
    drop = _dare_drop(drop_rate, rescale, rescale_mode, seed)

    def delta(key: str, task_vectors: list[tuple[_Expert, torch.Tensor]]) -> torch.Tensor:
        return _sum_delta(key, [(expert, drop(expert, key, tau)) for expert, tau in task_vectors])

    record = {
        "method": "dare",
        "scaling_factor": scaling_factor,
        "drop_rate": drop_rate,
        "rescale": rescale,
        "rescale_mode": rescale_mode,
        "seed": seed,
        "experts": _names(experts),
    }
    return _merge(base_model, experts, scaling_factor, record, delta)


def dare_ties_merging(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    scaling_factor: float = 0.3,
    drop_rate: float = 0.9,
    rescale: bool = True,
    seed: int = 0,
    *,
    rescale_mode: str = "keep_rate",
    merge_func: str = "sum",
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with DARE-TIES: DARE's drop and rescale in
    place of TIES' magnitude trim.

    1. **Drop and rescale** each ``tau_i = theta_i - theta_0`` exactly as ``dare_merging`` does
       (same masks for the same ``seed``, expert name and tensor).
    2. **Elect sign** per entry: the sign of the sum of the dropped task vectors (a zero sum elects
       ``+``), as ``ties_merging``.
    3. **Disjoint merge**: per entry, the sum (``merge_func="sum"``, default) or the mean
       (``"mean"``) of the dropped entries whose sign equals the elected one (zeros never count).
    4. ``theta = theta_0 + scaling_factor * merged``.

{rescale}

    ``merge_func="sum"`` is the default because the rescaling already restores the experts'
    magnitude and both peers sum: mergekit 0.1.5's ``dare_ties`` (``normalize: false``,
    ``rescale: true`` = ``rescale_mode="l1"``, per-tensor masks; the same merge, up to its RNG)
    and FusionBench 0.2.33's ``DareTiesMerging`` (``merge_func: sum``, ``1 / (1 - p)``), which in
    addition trims the dropped vectors by magnitude (its ``threshold``, globally, as in its TIES)
    before the sign election; that extra trim is not done here.

{randomness}

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        scaling_factor: ``lambda``, in ``[-100, 100]``.
        drop_rate: Drop probability ``p`` in ``[0, 1)``.
        rescale: Rescale the kept entries.
        seed: Integer seed.
        rescale_mode: ``"keep_rate"`` (divide by ``1 - p``) or ``"l1"`` (keep each tensor's L1 norm).
        merge_func: ``"sum"`` or ``"mean"`` of the entries that agree with the elected sign.

    Returns:
        A new model with ``config.hf_featcal_merge = {{"method": "dare_ties", "scaling_factor": ...,
        "drop_rate": ..., "rescale": ..., "rescale_mode": ..., "seed": ..., "merge_func": ...,
        "experts": [...]}}``.

    Raises:
        ValueError: on an invalid argument (named in the message) or mismatched architectures.
    """
    scaling_factor, drop_rate, rescale, rescale_mode, seed, merge_func = _checked(
        "dare_ties", scaling_factor=scaling_factor, drop_rate=drop_rate, rescale=rescale, rescale_mode=rescale_mode,
        seed=seed, merge_func=merge_func,
    )
    _validate_base(base_model)
    _validate_experts(experts)
    drop = _dare_drop(drop_rate, rescale, rescale_mode, seed)

    def delta(key: str, task_vectors: list[tuple[_Expert, torch.Tensor]]) -> torch.Tensor:
        return _elect_and_merge(torch.stack([drop(expert, key, tau) for expert, tau in task_vectors]), merge_func)

    record = {
        "method": "dare_ties",
        "scaling_factor": scaling_factor,
        "drop_rate": drop_rate,
        "rescale": rescale,
        "rescale_mode": rescale_mode,
        "seed": seed,
        "merge_func": merge_func,
        "experts": _names(experts),
    }
    return _merge(base_model, experts, scaling_factor, record, delta)


for _function in (dare_merging, dare_ties_merging):  # the shared paragraphs (no docstrings under -OO)
    if _function.__doc__:
        _function.__doc__ = _function.__doc__.format(rescale=_DARE_RESCALE_DOC, randomness=_DARE_RANDOMNESS_DOC)
del _function


#: Method name -> merge function (``"simple_average"`` is an alias of ``"average"``, so the
#: ``method`` of a ``config.hf_featcal_merge`` record is always accepted).
MERGE_METHODS: dict[str, Callable[..., nn.Module]] = {
    "average": simple_average,
    "simple_average": simple_average,
    "task_arithmetic": task_arithmetic,
    "ties": ties_merging,
    "dare": dare_merging,
    "dare_ties": dare_ties_merging,
}
_check_declarations()


def merge_models(base_model: ModelLike, experts: Mapping[str, ModelLike], method: str, **params: object) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with the method named ``method``.

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id.
        method: ``"average"`` (``simple_average``; alias ``"simple_average"``), ``"task_arithmetic"``
            (``scaling_factor``), ``"ties"`` (``ties_merging``: ``scaling_factor``, ``density``,
            ``per_tensor_trim``, ``merge_func``), ``"dare"`` (``dare_merging``: ``scaling_factor``,
            ``drop_rate``, ``rescale``, ``seed``, ``rescale_mode``) or ``"dare_ties"``
            (``dare_ties_merging``: those of ``"dare"`` and ``merge_func``).
        **params: The method's parameters (defaults as in its function).

    Returns:
        The merged model (``config.hf_featcal_merge`` records method and parameters).

    Raises:
        ValueError: for an unknown ``method``, a parameter the method does not take, or an invalid
            value (the message names the argument).
    """
    if not isinstance(method, str) or method not in MERGE_METHODS:
        raise ValueError(f"`method` must be one of {sorted(MERGE_METHODS)}, got {method!r}")
    function = MERGE_METHODS[method]
    accepted = list(merge_parameters(method))
    for name in params:
        if name not in accepted:
            raise ValueError(
                f"`{name}` is not a parameter of merge method {method!r} (accepted: {accepted or 'none'})"
            )
    return function(base_model, experts, **params)
