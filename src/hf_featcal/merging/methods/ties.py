"""TIES-Merging (Yadav et al., NeurIPS 2023, "TIES-Merging: Resolving Interference When Merging
Models"): trim each task vector to its top-``density`` entries by magnitude (over the whole task
vector, or per tensor), elect a sign per entry, average the entries that agree with it ("disjoint
mean"), then ``theta = theta_0 + lambda * merged``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ..params import SCALING_FACTOR, MergeMethod, MergeParameter
from ..registry import get_method, register

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike
    from ..engine import Expert, PrepareFn

#: How the sign-elected entries combine (also DARE-TIES', with another default).
MERGE_FUNC = MergeParameter(
    "merge_func", str, "mean", "how the sign-elected entries combine: disjoint mean or sum", choices=("mean", "sum")
)


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
    import torch

    from ..engine import elect_and_merge, merge_task_vectors

    scaling_factor, density, per_tensor_trim, merge_func = get_method("ties").check(
        scaling_factor=scaling_factor, density=density, per_tensor_trim=per_tensor_trim, merge_func=merge_func
    )
    prepare: PrepareFn | None = None
    thresholds: dict[str, float] = {}
    if not per_tensor_trim:
        thresholds, prepare = _global_thresholds(density)

    def trim(expert: Expert, tau: torch.Tensor) -> torch.Tensor:
        if per_tensor_trim:
            return tau if density >= 1 else _trim_tensor(tau, density)
        return tau * (tau.abs() >= thresholds[expert.name])

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        return elect_and_merge(torch.stack([trim(expert, tau) for expert, tau in task_vectors]), merge_func)

    params = {"scaling_factor": scaling_factor, "density": density, "per_tensor_trim": per_tensor_trim,
              "merge_func": merge_func}
    return merge_task_vectors(base_model, experts, "ties", params, delta, scaling_factor=scaling_factor,
                              prepare=prepare)


def _kept_count(density: float, entries: int) -> int:
    """Entries a magnitude trim keeps: ``int(density * entries)``, but at least one of a non-empty
    tensor / task vector (as mergekit 0.1.5; a small tensor would otherwise lose its update entirely)."""
    return max(1, int(density * entries)) if entries > 0 else 0


def _trim_tensor(tau: torch.Tensor, density: float) -> torch.Tensor:
    """``tau`` with all but its ``_kept_count(density, numel)`` largest-magnitude entries zeroed
    (exactly that many: ``torch.topk`` picks among equal magnitudes at the boundary)."""
    import torch

    keep = _kept_count(density, tau.numel())
    if keep >= tau.numel():
        return tau
    flat = tau.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[flat.abs().topk(keep).indices] = 1.0
    return (flat * mask).view_as(tau)


def _global_thresholds(density: float) -> tuple[dict[str, float], PrepareFn]:
    """A ``prepare`` step computing, per expert, the magnitude threshold that keeps its top
    ``density`` fraction of entries over its whole task vector (all covered tensors together)."""
    from ..engine import kth_largest_magnitude

    thresholds: dict[str, float] = {}

    def prepare(readers: list[Expert], state: dict[str, torch.Tensor]) -> None:
        for reader in readers:

            def magnitudes(reader: Expert = reader) -> Iterator[torch.Tensor]:
                for key in reader.keys:
                    yield reader.task_vector(key, state[key].detach().float()).abs_()

            covered = sum(state[key].numel() for key in reader.keys)
            k = _kept_count(density, reader.size if reader.size is not None else covered)
            # beyond the covered entries the task vector is zero: the k-th largest is then 0
            thresholds[reader.name] = 0.0 if k > covered else kth_largest_magnitude(magnitudes, k)

    return thresholds, prepare


METHOD = register(MergeMethod(
    "ties", ties_merging, summary="trim, elect sign, disjoint mean",
    reference="Yadav et al., NeurIPS 2023, \"TIES-Merging: Resolving Interference When Merging Models\"",
    parameters=(
        SCALING_FACTOR,
        MergeParameter("density", float, 0.2, "fraction of task-vector entries kept by the magnitude trim",
                       interval=(0.0, 1.0, True, False)),
        MergeParameter("per_tensor_trim", bool, False, "trim each tensor on its own (else over the whole task vector)"),
        MERGE_FUNC,
    ),
    paper_defaults={"scaling_factor": 0.3, "density": 0.2},
    svc_alpha=0.1,  # FusionBench's SVC config after this merge
))
