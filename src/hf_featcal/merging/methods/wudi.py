"""WUDI merging (Cheng et al., ICML 2025, "Whoever Started the Interference Should End It: Guiding
Data-Free Model Merging via Task Vectors"): data-free. Each weight matrix's merged task vector is
found by a few hundred Adam steps on the interference the task vectors themselves predict,

    min over τ_m of  Σ_i ‖(τ_m − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F,   starting from τ_m = Σ_i τ_i,

(the rows of a task vector span its layer's inputs, so ``(τ_m − τ_i) τ_iᵀ`` stands for the error of the
merged layer on task i's inputs); every other tensor is the mean of the task vectors;
``theta = theta_0 + τ_m`` (no scaling coefficient).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..params import MergeMethod, MergeParameter
from ..registry import get_method, register

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...model_io import ModelLike
    from ..engine import Expert

# Adam's other settings: torch's defaults, as FusionBench leaves them (not parameters)
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def wudi_merging(
    base_model: ModelLike,
    experts: Mapping[str, ModelLike],
    iter_num: int = 300,
    lr: float = 1e-5,
) -> nn.Module:
    """Merge ``experts`` into a copy of ``base_model`` with WUDI merging (Cheng et al. 2025).

    With task vectors ``tau_i = theta_i - theta_0`` in float32 (``T = len(experts)``):

    * every 2-D floating-point tensor (Linear weights, and also embeddings, position embeddings and
      heads, as FusionBench, whose config excludes no key): ``tau_m`` starts at ``sum_i tau_i`` and
      takes ``iter_num`` Adam steps (learning rate ``lr``, betas (0.9, 0.999), eps 1e-8, no weight
      decay; float32) on ``L(tau_m) = sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2``;
    * every other floating-point tensor (biases, norms, convolutions, 1-D embeddings): the mean
      ``sum_i tau_i / T``;
    * ``theta = theta_0 + tau_m``, cast back to the base tensor's dtype.

    The gradient is taken in closed form, ``dL/dtau_m = 2 (tau_m A - B)`` with
    ``A = sum_i tau_i^T tau_i / ||tau_i||^2`` (in x in) and ``B = sum_i tau_i tau_i^T tau_i /
    ||tau_i||^2`` (out x in), both computed once per matrix: the same loss and the same Adam steps as
    FusionBench's autograd on the stacked products, with other float32 rounding, at a cost per step
    of one ``(out x in) @ (in x in)`` product whatever ``T``.

    Memory: the engine streams one tensor key at a time (experts given by path are read lazily), so
    besides the result (one model) this holds one matrix's ``T`` task vectors, the merged matrix, its
    gradient, Adam's two moment buffers and its denominator (``out x in`` each), ``B`` (``out x in``)
    and ``A`` (``in x in``). FusionBench holds every task vector of the whole model at once, plus per step the
    ``T`` products ``(out x out)`` and their gradients: for a token embedding (vocabulary x hidden)
    that is ``T`` vocabulary-square matrices, here one hidden-square one.

    Cost: ``iter_num`` optimiser steps per 2-D tensor, on the base model's device (pass a base on a GPU
    to run them there); a progress bar counts them. It follows transformers' progress-bar switch
    (``transformers.utils.logging.disable_progress_bar()``, which ``--quiet`` of ``hf-featcal run`` and
    ``compare`` sets): a progress switch is not a merge setting, so it is not a declared parameter
    (those become ``hf-featcal merge`` flags and recipe keys and are recorded with the merge).

    Reference: FusionBench 0.2.33 ``fusion_bench.method.wudi.wudi.WUDIMerging`` (``wudi_merging``;
    config ``method/wudi/wudi.yaml``). Differences by design:

    * the gradient's closed form above, and torch.optim.Adam's single-tensor update written out
      (FusionBench calls torch.optim.Adam, whose CUDA path orders the same operations otherwise):
      rounding only, far less memory and time per step;
    * an expert whose task vector of a matrix is zero (its weights equal the base's there, e.g. a
      frozen embedding, or a key it does not cover) brings no term to that matrix's loss; FusionBench
      divides by its zero norm and the merge turns NaN. Experts lacking a key count as a zero task
      vector in the mean (the divisor stays ``T``), as in `simple_average`;
    * ``iter_num`` defaults to 300, the default of FusionBench's function (its YAML config says 400);
      ``lr`` (fixed at 1e-5 in FusionBench) is a parameter too; FusionBench's ``exclude_keys`` (none
      in its config) is not offered;
    * integer buffers are never merged (FusionBench subtracts and adds every state-dict entry).

    Args:
        base_model: Pre-trained model, or its local folder / hub id.  Not modified.
        experts: Mapping task name -> fine-tuned model, or local folder / hub id (read lazily).
        iter_num: Adam steps per 2-D tensor, in ``[1, 100000]``.
        lr: Adam's learning rate, in ``(0, 1]``.

    Returns:
        A new model with ``config.hf_featcal_merge = {"method": "wudi", "iter_num": ..., "lr": ...,
        "experts": [...]}``.

    Raises:
        ValueError: on an invalid argument (named in the message, before any tensor is read),
            mismatched architectures, non-finite weights, or a non-finite optimisation result.
    """
    from ...progress import progress_bar
    from ..engine import merge_task_vectors, sum_delta, validate_base, validate_experts

    iter_num, lr = get_method("wudi").check(iter_num=iter_num, lr=lr)
    validate_base(base_model)
    validate_experts(experts)  # before its length is taken
    num_tasks = len(experts)
    bars: list = []

    def open_progress_bar(readers: list[Expert], state: dict[str, torch.Tensor]) -> None:
        covered = {key for reader in readers for key in reader.keys}
        matrices = sum(1 for key in covered if state[key].dim() == 2)
        bars.append(progress_bar(total=matrices * iter_num, unit="step",
                                 desc=f"WUDI: {matrices} matrices × {iter_num} Adam steps"))

    def delta(key: str, task_vectors: list[tuple[Expert, torch.Tensor]]) -> torch.Tensor:
        total = sum_delta(key, task_vectors)
        if total.dim() != 2:
            return total / num_tasks
        bars[0].set_postfix_str(key, refresh=False)
        merged = minimise_interference([tau for _, tau in task_vectors], total, iter_num, lr, bars[0].update)
        if not bool(merged.isfinite().all()):  # the inputs are finite: the steps overflowed
            raise ValueError(
                f"WUDI's optimisation of {key!r} is not finite (NaN/Inf) with `lr`={lr!r}; refusing it (the base "
                "model and the experts are unchanged)."
            )
        return merged

    try:
        return merge_task_vectors(base_model, experts, "wudi", {"iter_num": iter_num, "lr": lr}, delta,
                                  scaling_factor=1.0, prepare=open_progress_bar)
    finally:
        for bar in bars:
            bar.close()


def minimise_interference(
    task_vectors: list[torch.Tensor],
    start: torch.Tensor,
    iter_num: int,
    lr: float,
    on_step: Callable[[int], object] = lambda steps: None,
) -> torch.Tensor:
    """``iter_num`` Adam steps from ``start`` on ``sum_i ||(tau_m - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2``
    over the (out x in) ``task_vectors`` (zero ones skipped: they bring no term); the result, a new
    tensor.  ``on_step(1)`` is called after every step."""
    import torch

    # the loss is quadratic in tau_m: its gradient 2 (tau_m A - B) needs only A and B
    gram_sum = start.new_zeros(start.shape[1], start.shape[1])  # A
    cross = torch.zeros_like(start)  # B
    for tau in task_vectors:
        norm_sq = tau.square().sum()
        if not bool(norm_sq > 0):
            continue
        gram = (tau.T @ tau).div_(norm_sq)
        gram_sum += gram
        cross += tau @ gram
    # Adam as torch.optim.Adam computes it (its single-tensor update, op for op), written out: the
    # optimiser object costs far more per step than a small matrix's product
    merged = start.clone()
    grad, first, second, denom = (torch.zeros_like(start) for _ in range(4))
    beta1, beta2 = ADAM_BETAS
    for step in range(1, iter_num + 1):
        torch.addmm(cross, merged, gram_sum, beta=-2.0, alpha=2.0, out=grad)
        first.lerp_(grad, 1 - beta1)
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.sqrt(second, out=denom).div_((1 - beta2**step) ** 0.5).add_(ADAM_EPS)
        merged.addcdiv_(first, denom, value=-lr / (1 - beta1**step))
        on_step(1)
    return merged


METHOD = register(MergeMethod(
    "wudi", wudi_merging, summary="per-matrix Adam on the task vectors' interference (data-free)",
    reference="Cheng et al., ICML 2025, \"Whoever Started the Interference Should End It: Guiding Data-Free Model "
              "Merging via Task Vectors\"; FusionBench fusion_bench.method.wudi.wudi.WUDIMerging",
    parameters=(
        MergeParameter("iter_num", int, 300, "Adam steps per 2-D tensor (the merge's cost)",
                       interval=(1, 100_000, False, False)),
        MergeParameter("lr", float, 1e-5, "Adam's learning rate", interval=(0.0, 1.0, True, False)),
    ),
    paper_defaults={"iter_num": 300, "lr": 1e-5},
    svc_alpha=1.0,  # FusionBench's SVC config after this merge
))
