"""DARE (Yu et al., ICML 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous
Models as a Free Lunch"): drop each task-vector entry with probability ``p`` (seeded, reproducible),
rescale the rest by ``1 / (1 - p)`` (or, ``rescale_mode="l1"``, so that each tensor keeps its L1
norm, as mergekit), then Task Arithmetic.  DARE-TIES (`hf_featcal.merging.methods.dare_ties`) shares
the drop and its parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..params import SCALING_FACTOR, MergeMethod, MergeParameter
from ..registry import get_method, register

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike
    from ..engine import Expert

#: The parameters of the drop and rescale (DARE-TIES takes them too), after λ.
DARE_PARAMETERS = (
    SCALING_FACTOR,
    MergeParameter("drop_rate", float, 0.9, "probability p of dropping each task-vector entry",
                   interval=(0.0, 1.0, False, True)),
    MergeParameter("rescale", bool, True, "rescale the kept entries (see rescale_mode)"),
    MergeParameter("seed", int, 0, "seed of the drop masks"),
    MergeParameter(
        "rescale_mode", str, "keep_rate",
        "keep_rate: divide kept entries by 1 − p; l1: keep each tensor's L1 norm", choices=("keep_rate", "l1"),
    ),
)
#: ``rescale_mode`` values: divide by the keep rate ``1 - p`` (DARE paper, FusionBench), or match
#: each tensor's L1 norm before the drop (mergekit).
DARE_RESCALE_MODES = DARE_PARAMETERS[-1].choices
#: below this L1 norm (before or after the drop) a tensor is left unscaled, as mergekit (its eps)
_L1_RESCALE_EPS = 1e-7

RANDOMNESS_DOC = """\
    Randomness is reproducible and independent of torch's global RNG (left untouched): the keep
    mask of expert ``name`` for the base state-dict key ``key`` (the merged model's name of the
    tensor) is ``torch.rand(shape, generator=g) >= p`` with a CPU generator ``g`` seeded by the first
    8 bytes (little-endian, top bit cleared) of ``sha256(f"{seed}:{name}:{key}")``.  The result thus
    does not depend on the experts' order, on their device, or on whether they are given as models
    or as folders."""

RESCALE_DOC = """\
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
    from ..engine import merge_task_vectors, sum_delta

    scaling_factor, drop_rate, rescale, rescale_mode, seed = get_method("dare").check(
        scaling_factor=scaling_factor, drop_rate=drop_rate, rescale=rescale, rescale_mode=rescale_mode, seed=seed
    )
    drop = dare_drop(drop_rate, rescale, rescale_mode, seed)

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        return sum_delta(key, [(expert, drop(expert, key, tau)) for expert, tau in task_vectors])

    params = {"scaling_factor": scaling_factor, "drop_rate": drop_rate, "rescale": rescale,
              "rescale_mode": rescale_mode, "seed": seed}
    return merge_task_vectors(base_model, experts, "dare", params, delta, scaling_factor=scaling_factor)


if dare_merging.__doc__:  # the paragraphs DARE-TIES shares (no docstrings under -OO)
    dare_merging.__doc__ = dare_merging.__doc__.format(rescale=RESCALE_DOC, randomness=RANDOMNESS_DOC)


def _drop_generator(seed: int, expert: str, key: str) -> torch.Generator:
    """The CPU generator for expert ``expert``'s tensor at base key ``key``: seeded with the first 8
    bytes (little-endian, top bit cleared) of ``sha256(f"{seed}:{expert}:{key}")``."""
    import hashlib

    import torch

    digest = hashlib.sha256(f"{seed}:{expert}:{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def dare_drop(
    drop_rate: float, rescale: bool, rescale_mode: str, seed: int
) -> Callable[[Expert, str, torch.Tensor], torch.Tensor]:
    """``drop(expert, key, tau)``: the seeded DARE drop of one tensor, then its rescaling."""
    import torch

    def drop(expert: Expert, key: str, tau: torch.Tensor) -> torch.Tensor:
        if drop_rate == 0:
            return tau
        keep = torch.rand(tau.shape, generator=_drop_generator(seed, expert.name, key)) >= drop_rate
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


METHOD = register(MergeMethod(
    "dare", dare_merging, summary="random drop and rescale, then Task Arithmetic",
    reference="Yu et al., ICML 2024, \"Language Models are Super Mario: Absorbing Abilities from Homologous Models "
    "as a Free Lunch\"",
    parameters=DARE_PARAMETERS, paper_defaults={"scaling_factor": 0.3, "drop_rate": 0.9},
    svc_alpha=0.1,  # FusionBench's SVC config after this merge
))
