"""DARE-TIES: DARE's drop and rescale (`hf_featcal.merging.methods.dare`) in place of TIES' magnitude
trim, then TIES' sign election and disjoint merge (Yu et al., ICML 2024, applied to Yadav et al.,
NeurIPS 2023)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..params import MergeMethod
from ..registry import get_method, register
from .dare import DARE_PARAMETERS, RANDOMNESS_DOC, RESCALE_DOC, dare_drop
from .ties import MERGE_FUNC

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike
    from ..engine import Expert


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
    import torch

    from ..engine import elect_and_merge, merge_task_vectors

    scaling_factor, drop_rate, rescale, rescale_mode, seed, merge_func = get_method("dare_ties").check(
        scaling_factor=scaling_factor, drop_rate=drop_rate, rescale=rescale, rescale_mode=rescale_mode,
        seed=seed, merge_func=merge_func,
    )
    drop = dare_drop(drop_rate, rescale, rescale_mode, seed)

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        return elect_and_merge(torch.stack([drop(expert, key, tau) for expert, tau in task_vectors]), merge_func)

    params = {"scaling_factor": scaling_factor, "drop_rate": drop_rate, "rescale": rescale,
              "rescale_mode": rescale_mode, "seed": seed, "merge_func": merge_func}
    return merge_task_vectors(base_model, experts, "dare_ties", params, delta, scaling_factor=scaling_factor)


if dare_ties_merging.__doc__:  # DARE's paragraphs (no docstrings under -OO)
    dare_ties_merging.__doc__ = dare_ties_merging.__doc__.format(rescale=RESCALE_DOC, randomness=RANDOMNESS_DOC)


METHOD = register(MergeMethod(
    "dare_ties", dare_ties_merging, summary="DARE's drop and rescale, then TIES' sign election and disjoint sum",
    reference="Yu et al., ICML 2024 (DARE) with Yadav et al., NeurIPS 2023 (TIES-Merging)",
    parameters=(*DARE_PARAMETERS, dataclasses.replace(MERGE_FUNC, default="sum")),
    paper_defaults={"scaling_factor": 0.3, "drop_rate": 0.9},
    svc_alpha=0.1,  # no FusionBench SVC config: TIES' and DARE's
))
