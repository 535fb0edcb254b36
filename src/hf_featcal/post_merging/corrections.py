"""The two representation corrections, as small `nn.Module`s acting on one representation vector per row.

- Representation Surgery (Yang et al., ICML 2024, arXiv 2402.02705), `SurgeryModule`:
  ẑ = z − U·ReLU(D·z), D: dim → rank, U: rank → dim, no biases; D has torch's default `nn.Linear`
  init and U starts at zero, so the module starts as the identity. Loss: mean |ẑ − z_expert|.
- ProbSurgery (Wei et al., ICML 2025, "Representation Surgery in Model Merging with Probabilistic
  Modeling"), `ProbSurgeryModule`: s = ReLU(A·z) (A: dim → hidden), μ = M·s, log σ² = V·s (M, V:
  hidden → dim), no biases; M and V start at zero (μ = 0, σ = 1). Training subtracts one
  reparameterised sample, ẑ = z − (μ + ε·σ) with ε ~ N(0, I); inference subtracts μ only. Loss: mean
  |ẑ − z_expert| + kl_weight · KL(N(μ, σ²) ‖ N(0, I)), the KL summed over the dimensions and averaged
  over the batch: ½ Σ_d (μ² + σ² − log σ² − 1).

Written from the papers' formulas (the ProbSurgery code has no licence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SurgeryModule(nn.Module):
    """ẑ = z − U·ReLU(D·z): `down` is D (dim → rank), `up` is U (rank → dim, zero at the start)."""

    def __init__(self, dim: int, rank: int = 16) -> None:
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)  # torch's default init
        self.up = nn.Linear(rank, dim, bias=False)
        nn.init.zeros_(self.up.weight)  # the identity at step 0

    def bias(self, z: Tensor) -> Tensor:
        """The representation bias the module removes, U·ReLU(D·z)."""
        return self.up(F.relu(self.down(z)))

    def forward(self, z: Tensor) -> Tensor:
        return z - self.bias(z)

    def training_loss(self, z: Tensor, target: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Mean L1 distance of the corrected `z` to `target` (the expert's representation)."""
        return (self(z) - target).abs().mean()


class ProbSurgeryModule(nn.Module):
    """s = ReLU(A·z), μ = M·s, log σ² = V·s; inference ẑ = z − μ, training ẑ = z − (μ + ε·σ)."""

    def __init__(self, dim: int, hidden: int = 128, kl_weight: float = 1e-4) -> None:
        super().__init__()
        self.encode = nn.Linear(dim, hidden, bias=False)  # A, torch's default init
        self.mean = nn.Linear(hidden, dim, bias=False)  # M
        self.log_variance = nn.Linear(hidden, dim, bias=False)  # V
        nn.init.zeros_(self.mean.weight)  # μ = 0 at step 0: the inference output starts as the identity
        nn.init.zeros_(self.log_variance.weight)  # σ = 1 at step 0
        self.kl_weight = kl_weight

    def distribution(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """(μ, log σ²) of the bias for each row of `z`."""
        s = F.relu(self.encode(z))
        return self.mean(s), self.log_variance(s)

    def forward(self, z: Tensor) -> Tensor:
        mu, _ = self.distribution(z)
        return z - mu

    def training_loss(self, z: Tensor, target: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Mean L1 of z − (μ + ε·σ) to `target` plus `kl_weight` · KL(N(μ, σ²) ‖ N(0, I)) (summed over
        dimensions, averaged over rows); ε drawn with `generator` (on the CPU, then moved)."""
        mu, log_variance = self.distribution(z)
        noise = torch.randn(mu.shape, generator=generator, dtype=mu.dtype).to(mu.device)
        sample = mu + noise * torch.exp(0.5 * log_variance)
        l1 = (z - sample - target).abs().mean()
        kl = 0.5 * (mu.pow(2) + log_variance.exp() - log_variance - 1).sum(dim=-1).mean()
        return l1 + self.kl_weight * kl


#: Method name → the correction class and the hyper-parameters its constructor takes.
CORRECTIONS: dict[str, tuple[type[nn.Module], tuple[str, ...]]] = {
    "surgery": (SurgeryModule, ("rank",)),
    "prob_surgery": (ProbSurgeryModule, ("hidden", "kl_weight")),
}
