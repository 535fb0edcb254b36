"""Accumulators for FeatCal's statistics: weighted sums per task, folded into task sums at task end.

Sums (not running means) are accumulated in the compute dtype (float32 or float64, never lower) and
divided by the task's weight total when the task is finished. Only the folded, task-summed
quantities the solver needs are kept across tasks, so memory does not grow with the number of tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .solver import task_scale

# A reduction applied to a task's raw sums before they are turned into means (e.g. an all-reduce
# across processes). Identity on one process.
SumReducer = Callable[[list[Tensor]], list[Tensor]]


def _identity_reducer(tensors: list[Tensor]) -> list[Tensor]:
    return tensors


def flatten_tokens(x: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(..., d) features and (...) weights → the rows with non-zero weight, as (M, d) and (M,)."""
    if x.dim() - 1 > weights.dim():  # per-head inputs (B, N, heads, d): every head of a token shares its weight
        weights = weights.reshape(*weights.shape, *([1] * (x.dim() - 1 - weights.dim()))).expand(x.shape[:-1])
    x = x.reshape(-1, x.shape[-1])
    w = weights.reshape(-1).to(device=x.device)
    keep = w > 0
    if not bool(keep.all()):
        x, w = x[keep], w[keep]
    return x, w


@dataclass
class LinearTargets:
    """Parameters of one Linear of the current task's expert, used to fold the task's statistics."""

    weight: Tensor
    bias: Tensor | None


@dataclass
class LinearGroupStatistics:
    """Statistics of the Linears that read one input with one set of token weights (e.g. q/k/v).

    Per task: Σw, Σw·x_s, Σw·x_t, Σw·x_s x_sᵀ, Σw·x_s x_tᵀ. Folded at task end into Σ s_i C_i,
    Σ s_i, Σ s_i μ_s,i and per module Σ s_i X_i W_iᵀ and Σ s_i (b_i + W_i μ_t,i).
    """

    modules: tuple[str, ...]
    dim: int
    dtype: torch.dtype
    device: torch.device
    epsilon: float
    #: Accumulate each module's right-hand side Σ w·x_s (W_i x_t)ᵀ directly instead of the d×d cross
    #: moment: cheaper when the modules' outputs together are narrower than their input (down projections).
    direct_rhs: bool = False
    # running sums of the current task
    _w: Tensor = field(init=False)
    _count: int = field(init=False, default=0)
    _sx_s: Tensor = field(init=False)
    _sx_t: Tensor = field(init=False)
    _gram: Tensor = field(init=False)
    _cross: Tensor | None = field(init=False, default=None)
    _rhs_task: dict[str, Tensor] = field(init=False, default_factory=dict)
    # folded over finished tasks
    gram_sum: Tensor | None = field(init=False, default=None)
    scale_sum: float = field(init=False, default=0.0)
    student_mean_sum: Tensor | None = field(init=False, default=None)
    rhs_sum: dict[str, Tensor] = field(init=False, default_factory=dict)
    bias_target_sum: dict[str, Tensor] = field(init=False, default_factory=dict)
    weighted_tokens: int = field(init=False, default=0)
    task_scales: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._reset_task()

    def _reset_task(self) -> None:
        d, kw = self.dim, {"dtype": self.dtype, "device": self.device}
        self._w = torch.zeros((), **kw)
        self._count = 0
        self._sx_s = torch.zeros(d, **kw)
        self._sx_t = torch.zeros(d, **kw)
        self._gram = torch.zeros(d, d, **kw)
        self._cross = None if self.direct_rhs else torch.zeros(d, d, **kw)
        self._rhs_task = {}

    def accumulate(
        self, x_student: Tensor, x_teacher: Tensor, weights: Tensor, targets: dict[str, LinearTargets] | None = None
    ) -> None:
        """Add one batch: student and teacher inputs (..., d) and token weights (...). With `direct_rhs`
        the task expert's parameters (`targets`) are needed here already."""
        x_s, w = flatten_tokens(x_student, weights)
        x_t, _ = flatten_tokens(x_teacher, weights)
        x_s = x_s.to(self.dtype)
        x_t = x_t.to(self.dtype)
        w = w.to(self.dtype)
        weighted = x_s * w[:, None]
        self._w += w.sum()
        self._count += int(w.numel())
        self._sx_s += weighted.sum(0)
        self._sx_t += (x_t * w[:, None]).sum(0)
        self._gram.addmm_(weighted.T, x_s)
        if not self.direct_rhs:
            self._cross.addmm_(weighted.T, x_t)
            return
        if targets is None:
            raise ValueError("direct right-hand-side accumulation needs the expert's parameters")
        for name in self.modules:
            y = x_t @ targets[name].weight.to(device=self.device, dtype=self.dtype).T
            if name in self._rhs_task:
                self._rhs_task[name].addmm_(weighted.T, y)
            else:
                self._rhs_task[name] = weighted.T @ y

    def finish_task(self, targets: dict[str, LinearTargets], reduce: SumReducer = _identity_reducer) -> None:
        """Fold the current task into the task sums, using the task's expert parameters."""
        count = torch.tensor(float(self._count), dtype=self.dtype, device=self.device)
        if self.direct_rhs:
            for name in self.modules:  # a process without batches of this task contributes zeros
                if name not in self._rhs_task:
                    self._rhs_task[name] = torch.zeros(
                        self.dim, targets[name].weight.shape[0], dtype=self.dtype, device=self.device
                    )
            moments = [self._rhs_task[name] for name in self.modules]
        else:
            moments = [self._cross]
        w, sx_s, sx_t, gram, count, *moments = reduce([self._w, self._sx_s, self._sx_t, self._gram, count, *moments])
        total = float(w)
        if total <= 0:
            raise ValueError(f"modules {list(self.modules)}: the task has no token with non-zero weight")
        c_i = gram / total
        s_i = task_scale(c_i, self.epsilon)
        mu_s, mu_t = sx_s / total, sx_t / total
        self.task_scales.append(s_i)
        self.weighted_tokens += int(count)
        self.gram_sum = s_i * c_i if self.gram_sum is None else self.gram_sum.add_(c_i, alpha=s_i)
        self.student_mean_sum = s_i * mu_s if self.student_mean_sum is None else self.student_mean_sum.add_(mu_s, alpha=s_i)
        self.scale_sum += s_i
        for index, name in enumerate(self.modules):
            expert = targets[name]
            w_i = expert.weight.to(device=self.device, dtype=self.dtype)
            # s_i · X_i W_iᵀ, with X_i = E_w[x_s x_tᵀ] (or its product with W_iᵀ accumulated directly)
            rhs = (s_i / total) * (moments[index] if self.direct_rhs else moments[0] @ w_i.T)
            self.rhs_sum[name] = rhs if name not in self.rhs_sum else self.rhs_sum[name].add_(rhs)
            target = w_i @ mu_t
            if expert.bias is not None:
                target = target + expert.bias.to(device=self.device, dtype=self.dtype)
            self.bias_target_sum[name] = s_i * target if name not in self.bias_target_sum else self.bias_target_sum[name].add_(target, alpha=s_i)
        self._reset_task()


@dataclass
class NormStatistics:
    """Statistics of one normalisation layer: per channel e_i = E_w[z²], m_i = E_w[z], z the input
    normalised without its affine. `centered` is True for LayerNorm, False for RMS norms."""

    name: str
    dim: int
    centered: bool
    norm_eps: float
    dtype: torch.dtype
    device: torch.device
    _w: Tensor = field(init=False)
    _sz: Tensor = field(init=False)
    _sz2: Tensor = field(init=False)
    _count: int = field(init=False, default=0)
    second_moment_sum: Tensor | None = field(init=False, default=None)
    mean_sum: Tensor | None = field(init=False, default=None)
    gamma_target_sum: Tensor | None = field(init=False, default=None)
    beta_target_sum: Tensor | None = field(init=False, default=None)
    num_tasks: int = field(init=False, default=0)
    weighted_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._reset_task()

    def _reset_task(self) -> None:
        kw = {"dtype": self.dtype, "device": self.device}
        self._w = torch.zeros((), **kw)
        self._sz = torch.zeros(self.dim, **kw)
        self._sz2 = torch.zeros(self.dim, **kw)
        self._count = 0

    def normalise(self, x: Tensor) -> Tensor:
        """The norm's input normalised per token, without its affine parameters."""
        x = x.to(self.dtype)
        if self.centered:
            x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)

    def accumulate(self, x_student: Tensor, weights: Tensor) -> None:
        """Add one batch of the norm's student-side inputs (..., d) with token weights (...)."""
        x, w = flatten_tokens(x_student, weights)
        z = self.normalise(x)
        w = w.to(self.dtype)[:, None]
        self._w += w.sum()
        self._count += int(w.numel())
        self._sz += (w * z).sum(0)
        self._sz2 += (w * z.square()).sum(0)

    def finish_task(self, gamma: Tensor, beta: Tensor | None, reduce: SumReducer = _identity_reducer) -> None:
        """Fold the current task, given the task expert's (γ_i, β_i)."""
        count = torch.tensor(float(self._count), dtype=self.dtype, device=self.device)
        w, sz, sz2, count = reduce([self._w, self._sz, self._sz2, count])
        total = float(w)
        if total <= 0:
            raise ValueError(f"module {self.name}: the task has no token with non-zero weight")
        m_i, e_i = sz / total, sz2 / total
        g_i = gamma.to(device=self.device, dtype=self.dtype)
        b_i = None if beta is None else beta.to(device=self.device, dtype=self.dtype)
        gamma_target = e_i * g_i if b_i is None else e_i * g_i + m_i * b_i
        beta_target = None if b_i is None else m_i * g_i + b_i

        def add(acc: Tensor | None, value: Tensor | None) -> Tensor | None:
            if value is None:
                return None
            return value.clone() if acc is None else acc.add_(value)

        self.second_moment_sum = add(self.second_moment_sum, e_i)
        self.mean_sum = add(self.mean_sum, m_i)
        self.gamma_target_sum = add(self.gamma_target_sum, gamma_target)
        self.beta_target_sum = add(self.beta_target_sum, beta_target)
        self.num_tasks += 1
        self.weighted_tokens += int(count)
        self._reset_task()
