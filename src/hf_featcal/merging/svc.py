"""Singular Value Calibration (SVC), a data-free post-merging step: "When Shared Knowledge Hurts:
Spectral Over-Accumulation in Model Merging" (arXiv 2602.05536, 2026). Reference implementation:
FusionBench 0.2.33, ``fusion_bench.method.singular_value_calibration.SingularValueCalibration``
(``method/singular_value_calibration/svc.py``; the rule in ``utils.py``,
``subspace_consistency_spectral_calibration_accelerated``, its default).

For every 2-D parameter ``W`` the experts cover, with ``ΔW = W_merged − W_0`` and the task matrices
``ΔW_i = W_i − W_0`` (K experts):

    ΔW = U diag(σ) Vᵀ                                  (thin SVD, R = min(m, n) directions)
    a_r = u_rᵀ ΔW,   a_r^i = u_rᵀ ΔW_i                 (responses along the merged left direction u_r)
    s_r^i = ⟨a_r, a_r^i⟩ / ‖a_r^i‖²                      (how much of task i the merge holds along u_r)
    γ_r = K / Σ_i max(α, s_r^i)                         (> 1 under-counted, < 1 over-counted)
    W_svc = W_0 + U diag(γ σ) Vᵀ

Everything else (biases, norms, convolutions, 1-D embeddings, buffers) keeps the merged values.
Importing this module loads no torch (the CLI and the recipe schema read `SVC_ALPHA`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .params import MergeParameter

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..model_io import ModelLike
    from .engine import Expert

__all__ = ["SVC_ALPHA", "SVC_REFERENCE", "singular_value_calibration", "svc_alpha_for"]

SVC_REFERENCE = (
    "\"When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging\" (arXiv 2602.05536, 2026); "
    "FusionBench 0.2.33 fusion_bench.method.singular_value_calibration.SingularValueCalibration"
)

# α > 0 keeps every γ_r finite and positive (γ_r ≤ 1/α): with α ≤ 0 a sum of coefficients can be 0 or
# negative, which flips or blows up a direction. The default is FusionBench's (its calibration
# functions' and its class docstring's): with α = 1 SVC only shrinks over-counted directions.
SVC_ALPHA = MergeParameter(
    "alpha", float, 1.0, "SVC floor α of each task's projection coefficient: γ_r = K / Σ_i max(α, s_r^i)",
    metavar="α", interval=(0.0, math.inf, True, True),
)


# FusionBench's floor on ‖a_r^i‖², so that a task with no response along u_r gives s_r^i = 0
_MIN_RESPONSE_NORM = 1e-12


def svc_alpha_for(merge_method: str | None) -> float:
    """The α SVC uses after `merge_method`: the ``svc_alpha`` the method's file declares (FusionBench's
    SVC config for that merge), else `SVC_ALPHA`'s default (also for None or an unknown name)."""
    from .registry import get_method

    try:
        declared = get_method(merge_method).svc_alpha if merge_method else None
    except KeyError:
        declared = None
    return SVC_ALPHA.default if declared is None else declared


def singular_value_calibration(
    merged_model: ModelLike,
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    *,
    alpha: float = 1.0,
    device: str | torch.device | None = None,
) -> nn.Module:
    """Calibrate the singular values of a merged model's matrices (SVC; the module docstring has the
    formulas), after any merge.

    Touched: every 2-D *parameter* (``named_parameters``, tied ones once) at least one expert covers:
    the Linear weights, and 2-D embeddings and heads (token and position embeddings, ``lm_head``,
    CLIP's projections), as FusionBench touches every 2-D parameter. An expert that lacks a covered
    matrix (a LoRA adapter's unadapted weights) is the base there: its ΔW_i is 0, so s_r^i = 0.

    Memory: the result (a copy of ``merged_model``) and, per matrix, a few m × n float64 matrices:
    ΔW, U, Vᵀ, the merged responses and one expert's ΔW_i and responses at a time (experts and a base
    given as folders are read lazily, tensor by tensor).

    Differences from FusionBench, by design:
    - a matrix no expert covers is left as merged (FusionBench calibrates it with all ΔW_i = 0, which
      scales its ΔW by 1/α; such a matrix is e.g. the text tower of a CLIPModel whose experts are
      vision towers, where FusionBench's full-model experts give ΔW = 0 and so the same result);
    - α must be > 0 (FusionBench takes any value);
    - the SVDs run where each tensor lives or on ``device`` (FusionBench: CUDA when available);
    - a matrix with ΔW = 0 is not decomposed (U diag(γσ) Vᵀ = 0 either way).
    Like its default ("accelerated") variant, everything is computed in float64 and cast back to the
    merged tensor's dtype, with ‖a_r^i‖² floored at 1e-12.

    Args:
        merged_model: The merged model (any merge), or its local folder / hub id. Not modified.
        base_model: The pre-trained model the experts were fine-tuned from, or its folder / hub id
            (read lazily). Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily), as for
            the merge methods (e.g. ``CLIPVisionModel`` experts of a ``CLIPModel``). Not modified.
        alpha: α > 0, the floor of each task's projection coefficient (`SVC_ALPHA`; FusionBench's
            per-merge settings: `svc_alpha_for`).
        device: where the SVDs run (default: where each merged tensor lives).

    Returns:
        A new model: the merged one with its matrices calibrated. Its merge record
        (``config.hf_featcal_merge``, kept from ``merged_model``) gets a ``"post_merging"`` list with
        ``{"method": "svc", "alpha": α, "experts": [...], "matrices": <how many were calibrated>}``.

    Raises:
        ValueError: for ``alpha`` outside (0, inf) or an invalid argument (before any tensor is read),
            ``experts`` named otherwise than in the merge record of ``merged_model`` (when it has one;
            before any tensor of the base or the experts is read),
            a base or an expert that does not line up with the merged model, non-finite inputs, or a
            non-finite result (naming the matrix).
    """
    import torch
    from torch import nn

    from ..model_io import load_model, resolve_checkpoint
    from ..progress import progress_bar
    from .engine import (
        canonical_keys,
        float_state,
        merge_record,
        open_expert,
        record_merge,
        validate_base,
        validate_experts,
    )

    try:
        alpha = SVC_ALPHA.check(alpha)
    except ValueError as err:
        raise ValueError(f"`alpha` {err}") from None
    if not isinstance(merged_model, (nn.Module, str, os.PathLike)):
        raise ValueError("`merged_model` must be a torch.nn.Module / PreTrainedModel, a local folder or a hub id, "
                         f"got {type(merged_model).__name__}")
    validate_base(base_model)
    validate_experts(experts)
    if not isinstance(base_model, nn.Module) and resolve_checkpoint(base_model, "base_model").adapter is not None:
        raise ValueError("`base_model` must be a full model, not a LoRA adapter (the experts may be adapters)")

    result = copy.deepcopy(merged_model) if isinstance(merged_model, nn.Module) else load_model(
        merged_model, "merged_model")
    recorded = (merge_record(result) or {}).get("experts")
    if isinstance(recorded, list) and sorted(map(str, recorded)) != sorted(map(str, experts)):
        raise ValueError(
            f"`experts` must be the experts `merged_model` was merged from, which its merge record names: "
            f"{list(recorded)}; got {list(experts)} (SVC measures how much of each task the merge holds: the "
            "tasks must be the merge's own)."
        )
    state = float_state(result)  # shares storage with the result's parameters
    canonical = canonical_keys(state)
    parameters = {name for name, _ in result.named_parameters(remove_duplicate=False)}
    matrices = [k for k in dict.fromkeys(canonical.values()) if k in parameters and state[k].dim() == 2]
    label = f"`merged_model` ({type(result).__name__})"
    calibrated = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        base = open_expert("base_model", base_model, result, state, canonical, label, stack, "`base_model`")
        # an adapter expert is the base model plus its delta (ΔW_i = B_i A_i · scale), not the merge plus it
        readers = [open_expert(name, source, result, state, canonical, label, stack, base=base)
                   for name, source in experts.items()]
        for key in stack.enter_context(progress_bar(matrices, desc="SVC", unit="matrix")):
            if not any(key in reader.keys for reader in readers):
                continue
            if key not in base.keys:
                raise ValueError(f"`base_model` lacks {key!r}, which the experts have")
            value = _calibrated_matrix(key, state[key], base, readers, alpha, device)
            if value is not None:
                state[key].copy_(value)
                calibrated += 1

    record: dict[str, Any] = merge_record(result) or {}
    step = {"method": "svc", "alpha": alpha, "experts": [str(name) for name in experts], "matrices": calibrated}
    record["post_merging"] = [*record.get("post_merging", []), step]
    record_merge(result, record)
    return result


def _calibrated_matrix(
    key: str, target: torch.Tensor, base: Expert, readers: list[Expert], alpha: float,
    device: str | torch.device | None,
) -> torch.Tensor | None:
    """``W_0 + U diag(γσ) Vᵀ`` for one matrix, in the target's dtype; None when ΔW = 0 (nothing to do)."""
    import torch

    where = target.device if device is None else torch.device(device)
    merged = target.detach().to(device=where, dtype=torch.float64)
    if not bool(torch.isfinite(merged).all()):
        raise ValueError(f"`merged_model` has non-finite values (NaN/Inf) in {key!r}; refusing to calibrate.")
    theta_0 = base.read(key).to(device=where, dtype=torch.float64)
    delta = merged - theta_0
    if not bool(delta.any()):
        return None
    u, sigma, vh = torch.linalg.svd(delta, full_matrices=False)
    directions = u.T  # row r is u_rᵀ
    merged_responses = directions @ delta
    coefficient_sum = torch.zeros_like(sigma)
    for reader in readers:
        if key not in reader.keys:  # the expert is the base here: s_r^i = 0, so it adds max(α, 0) = α
            coefficient_sum += alpha
            continue
        responses = directions @ (reader.read(key).to(device=where, dtype=torch.float64) - theta_0)
        squared = (responses * responses).sum(dim=-1).clamp_min(_MIN_RESPONSE_NORM)
        coefficient_sum += ((merged_responses * responses).sum(dim=-1) / squared).clamp_min(alpha)
    gamma = len(readers) / coefficient_sum
    value = ((u * (gamma * sigma)) @ vh + theta_0).to(dtype=target.dtype, device=target.device)
    if not bool(torch.isfinite(value).all()):  # finite inputs, γ ≤ 1/α: only a narrow dtype overflows
        raise ValueError(f"SVC is not finite (NaN/Inf) in {key!r} with `alpha`={alpha!r} ({target.dtype}); "
                         "refusing it: use a larger `alpha` (the inputs are unchanged).")
    return value
