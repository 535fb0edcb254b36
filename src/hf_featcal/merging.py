"""Simple weight-space merging of task experts (Task Arithmetic, simple averaging).

Both functions return a *new* model (a deep copy of the base model); the base model and
the experts are never modified.  For every floating-point tensor of the state dict that the
experts share with the base model (same name, same shape) the merged value is::

    theta_m = theta_0 + scaling_factor * sum_i (theta_i - theta_0)

computed in float32 and cast back to the base tensor's dtype.  ``simple_average`` is the
special case ``scaling_factor = 1 / len(experts)``.

Mixed architectures are supported when the experts' state dict maps into the base's under a
key prefix, e.g. a ``CLIPModel`` base (``vision_model.encoder....``) with ``CLIPVisionModel``
experts (``encoder....``): only the part of the base the experts cover (the vision tower) is
merged, everything else keeps the base weights.

The merge is recorded on the result as ``merged.config.hf_featcal_merge`` (a JSON-serialisable
dict that survives ``save_pretrained``/``from_pretrained``)::

    {"method": "task_arithmetic", "scaling_factor": 0.3, "experts": ["task_a", "task_b"]}
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from numbers import Real

import torch
from torch import nn

__all__ = ["task_arithmetic", "simple_average", "find_key_prefix", "MERGE_CONFIG_ATTRIBUTE"]

#: Name of the config attribute that records how a model was merged.
MERGE_CONFIG_ATTRIBUTE = "hf_featcal_merge"


def _float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Floating-point entries of ``module.state_dict()`` (integer buffers are never merged)."""
    return {k: v for k, v in module.state_dict().items() if torch.is_floating_point(v)}


def find_key_prefix(base_keys: set[str] | Mapping[str, object], expert_keys: set[str] | Mapping[str, object]) -> str | None:
    """Return the prefix ``p`` such that ``p + k`` is a base key for every expert key ``k``.

    ``""`` is returned when the key sets line up directly.  Candidate prefixes are derived from
    base keys that end with an expert key (e.g. ``"vision_model."`` for a ``CLIPModel`` base and
    ``CLIPVisionModel`` experts); the shortest prefix that maps *all* expert keys wins.  Returns
    ``None`` when no prefix maps every expert key.
    """
    base = set(base_keys)
    expert = set(expert_keys)
    if not expert:
        return None
    if expert <= base:
        return ""
    probe = min(expert)  # any key works; min() keeps the choice deterministic
    candidates = sorted(
        {b[: len(b) - len(probe)] for b in base if b.endswith(probe) and len(b) > len(probe)},
        key=lambda p: (len(p), p),
    )
    for prefix in candidates:
        if all(prefix + k in base for k in expert):
            return prefix
    return None


def _validate_experts(experts: Mapping[str, nn.Module]) -> None:
    if not isinstance(experts, Mapping):
        raise ValueError(
            f"`experts` must be a mapping task name -> model, got {type(experts).__name__}"
        )
    if len(experts) == 0:
        raise ValueError("`experts` must contain at least one expert model, got an empty mapping")
    for name, expert in experts.items():
        if not isinstance(name, str):
            raise ValueError(f"`experts` keys must be task names (str), got {name!r}")
        if not isinstance(expert, nn.Module):
            raise ValueError(
                f"`experts[{name!r}]` must be a torch.nn.Module / PreTrainedModel, "
                f"got {type(expert).__name__}"
            )


def _merge(
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    scaling_factor: float,
    record: dict,
) -> nn.Module:
    if not isinstance(base_model, nn.Module):
        raise ValueError(
            f"`base_model` must be a torch.nn.Module / PreTrainedModel, got {type(base_model).__name__}"
        )
    _validate_experts(experts)

    base_state = _float_state(base_model)
    # Accumulate sum_i (theta_i - theta_0) in float32, per base key.
    deltas: dict[str, torch.Tensor] = {}
    for name, expert in experts.items():
        expert_state = _float_state(expert)
        prefix = find_key_prefix(base_state, expert_state)
        if prefix is None:
            missing = sorted(k for k in expert_state if k not in base_state)[:5]
            raise ValueError(
                f"expert {name!r} ({type(expert).__name__}) does not line up with the base model "
                f"({type(base_model).__name__}): no key prefix maps all of its state-dict keys into the "
                f"base state dict (e.g. unmatched expert keys: {missing})"
            )
        for key, value in expert_state.items():
            base_key = prefix + key
            base_value = base_state[base_key]
            if base_value.shape != value.shape:
                raise ValueError(
                    f"expert {name!r}: shape of {key!r} {tuple(value.shape)} does not match the base "
                    f"model's {base_key!r} {tuple(base_value.shape)}"
                )
            diff = value.detach().to(device=base_value.device, dtype=torch.float32) - base_value.detach().float()
            if base_key in deltas:
                deltas[base_key] += diff
            else:
                deltas[base_key] = diff

    merged = copy.deepcopy(base_model)
    merged_state = merged.state_dict()  # tensors share storage with the merged model's params/buffers
    with torch.no_grad():
        for base_key, delta in deltas.items():
            target = merged_state[base_key]
            new_value = base_state[base_key].detach().float() + scaling_factor * delta
            target.copy_(new_value.to(target.dtype))

    config = getattr(merged, "config", None)
    if config is not None:
        setattr(config, MERGE_CONFIG_ATTRIBUTE, record)
    return merged


def task_arithmetic(
    base_model: nn.Module,
    experts: Mapping[str, nn.Module],
    scaling_factor: float = 0.3,
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with Task Arithmetic.

    ``theta_m = theta_0 + scaling_factor * sum_i (theta_i - theta_0)`` on every floating-point
    state-dict tensor the experts share with the base model.

    Args:
        base_model: The pre-trained model the experts were fine-tuned from (a ``PreTrainedModel``).
            It is not modified.
        experts: Mapping task name -> fine-tuned model of the same architecture, or of a sub-module
            of the base (e.g. ``CLIPVisionModel`` experts for a ``CLIPModel`` base: only the vision
            tower is merged).  Not modified.
        scaling_factor: The task-vector scaling ``lambda`` (finite real number).

    Returns:
        A new model (deep copy of ``base_model``) holding the merged weights, with
        ``config.hf_featcal_merge = {"method": "task_arithmetic", "scaling_factor": ..., "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping, a non-finite ``scaling_factor``, or an
            expert whose state-dict keys/shapes do not line up with the base model.
    """
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, Real):
        raise ValueError(f"`scaling_factor` must be a real number, got {scaling_factor!r}")
    scaling_factor = float(scaling_factor)
    if not math.isfinite(scaling_factor):
        raise ValueError(f"`scaling_factor` must be finite, got {scaling_factor!r}")
    _validate_experts(experts)
    record = {
        "method": "task_arithmetic",
        "scaling_factor": scaling_factor,
        "experts": [str(k) for k in experts],
    }
    return _merge(base_model, experts, scaling_factor, record)


def simple_average(base_model: nn.Module, experts: Mapping[str, nn.Module]) -> nn.Module:
    """Average the experts' weights: Task Arithmetic with ``scaling_factor = 1 / len(experts)``.

    Equivalent to ``theta_m = mean_i theta_i`` on every shared floating-point tensor; tensors of
    the base that the experts do not cover keep the base weights.  Inputs are not modified.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "simple_average",
        "scaling_factor": 1/n, "experts": [...]}``.

    Raises:
        ValueError: on an empty/invalid ``experts`` mapping or mismatched architectures.
    """
    _validate_experts(experts)
    scaling_factor = 1.0 / len(experts)
    record = {
        "method": "simple_average",
        "scaling_factor": scaling_factor,
        "experts": [str(k) for k in experts],
    }
    return _merge(base_model, experts, scaling_factor, record)
