"""Accumulators for FeatCal's statistics: weighted sums per task, folded into task sums at task end.

Sums (not running means) are accumulated in the compute dtype (float32 or float64, never lower) and
divided by the task's weight total when the task is finished. Only the folded, task-summed
quantities the solver needs are kept across tasks, so memory does not grow with the number of tasks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._kernels.gemm import linear_product, low_precision_products_pay
from ._kernels.gram import (
    add_upper_gram,
    mirror_diagonal_blocks_,
    mirror_upper_,
    product,
    symmetric_from_upper,
    symmetric_upper_product,
    upper_blocks,
    upper_gram_norm,
)
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


@dataclass(frozen=True)
class PooledWeighting:
    """The token weighting of a pooled-head stack's last block: every token but the one at
    `token_index` counts `other_weight` times its own weight."""

    token_index: int
    other_weight: float


def outputs_rhs_pays(tokens: int, dim: int, alpha: float) -> bool:
    """Whether a direct right-hand side costs less arithmetic from the expert modules' outputs, for a
    task of `tokens` weighted tokens and an input `dim` wide: per module of n outputs,
    Σ w·x_s (W_i x_t)ᵀ = (1 − α)·(Σ w·x_s x_sᵀ) W_iᵀ + α·Σ w·x_s (y_e − b_i)ᵀ takes
    2·M·d·n [α ≠ 0] + 2·d²·n [α ≠ 1] multiply-adds (the first term once per task, from the Gram),
    projecting every teacher token 4·M·d·n: it pays above d tokens per task at 0 < α < 1."""
    from_outputs = (2 * tokens * dim if alpha != 0.0 else 0) + (2 * dim * dim if alpha != 1.0 else 0)
    return from_outputs < 4 * tokens * dim


@dataclass
class LinearGroupStatistics:
    """Statistics of the Linears that read one input with one set of token weights (e.g. q/k/v).

    Per task: Σw, Σw·x_s, Σw·x_e, Σw·x_s x_sᵀ (its block upper triangle) and Σw·x_s x_eᵀ, where the
    teacher is x_t = (1 − α)·x_s + α·x_e, so Σw·x_s x_tᵀ = (1 − α)·Σw·x_s x_sᵀ + α·Σw·x_s x_eᵀ needs
    no teacher tensor (and no cross moment at all for α = 0). Folded at task end into Σ s_i C_i,
    Σ s_i, Σ s_i μ_s,i and per module Σ s_i X_i W_iᵀ and Σ s_i (b_i + W_i μ_t,i).
    """

    modules: tuple[str, ...]
    dim: int
    dtype: torch.dtype
    device: torch.device
    epsilon: float
    #: Accumulate each module's right-hand side Σ w·x_s (W_i x_t)ᵀ directly instead of the d×d cross
    #: moment: cheaper when the modules' outputs together are narrower than their input (down projections).
    #: A task's batches may bring the expert modules' own outputs y_e = W_i x_e + b_i instead
    #: (`expert_outputs_pay`), which spares projecting the teacher tokens.
    direct_rhs: bool = False
    #: Fast mode: the dtype the products' factors are cast to (None: the accumulation dtype), where
    #: such products are faster (`_kernels.gemm.low_precision_products_pay`; elsewhere they stay float32).
    product_dtype: torch.dtype | None = None
    #: α of a task that saw no batch here (another process holds them): every process must hand the
    #: same sums to the cross-process reduction. 1.0 matches `accumulate` (its input is the teacher).
    teacher_alpha: float = 1.0
    #: A pooled-head stack's last block: the weights given to `accumulate_mixture` are the tokens' own,
    #: and the group applies the weighting w' = w·(o + (1 − o)·[pooled token]) itself, as
    #: Σ w'·f = o·Σ w·f + (1 − o)·Σ_pooled w·f for every sum f. The first term runs on unit weights
    #: (no weighted copy of the features), the second on the pooled token's rows alone, folded in
    #: at task end.
    pooled: PooledWeighting | None = None
    #: With `pooled`: the group of the same input without the weighting (k/v beside q), whose sums
    #: are this group's first term, so that this group adds only its pooled rows. Its task must be
    #: folded after this group's (`finish_task` reads its sums).
    main_from: LinearGroupStatistics | None = None
    # running sums of the current task
    _w: Tensor = field(init=False)
    _count: int = field(init=False, default=0)
    _alpha: float | None = field(init=False, default=None)
    _from_outputs: bool | None = field(init=False, default=None)  # whether the task's batches bring y_e
    _sx_s: Tensor = field(init=False)
    _sx_e: Tensor = field(init=False)
    _gram: Tensor | None = field(init=False, default=None)
    _cross: Tensor | None = field(init=False, default=None)
    _rhs_task: dict[str, Tensor] = field(init=False, default_factory=dict)
    # with `pooled`: the current task's pooled-token rows (student, expert, weights, expert outputs)
    _pooled_rows: list[tuple[Tensor, Tensor, Tensor, dict[str, Tensor] | None]] = field(
        init=False, default_factory=list)
    # scratch kept across batches and tasks: the teacher inputs of a batch (CPU), and per module the
    # buffer of the task's right-hand-side sum: on the CPU each fresh matrix is page-faulted in again
    # (fc2's teacher inputs at 1600 tokens: 19.7 MB, ~12 ms of faults per batch on an AMD EPYC VM)
    _teacher: Tensor | None = field(init=False, default=None)
    _rhs_buffers: dict[str, Tensor] = field(init=False, default_factory=dict)
    # folded over finished tasks (the Gram sum as its block upper triangle)
    _gram_sum_upper: Tensor | None = field(init=False, default=None)
    _gram_sum: Tensor | None = field(init=False, default=None)
    scale_sum: float = field(init=False, default=0.0)
    student_mean_sum: Tensor | None = field(init=False, default=None)
    rhs_sum: dict[str, Tensor] = field(init=False, default_factory=dict)
    bias_target_sum: dict[str, Tensor] = field(init=False, default_factory=dict)
    weighted_tokens: int = field(init=False, default=0)
    #: the sum of the token weights over the finished tasks: a token weighted 0.01 counts as 0.01
    effective_tokens: float = field(init=False, default=0.0)
    task_scales: list[float] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._reset_task()

    @property
    def gram_sum(self) -> Tensor | None:
        """Σ s_i C_i over the finished tasks (full and symmetric). The sum's own buffer, its lower
        blocks mirrored in place: read it, do not write it (a task folded later re-mirrors them)."""
        if self._gram_sum is None and self._gram_sum_upper is not None:
            self._gram_sum = mirror_upper_(self._gram_sum_upper)
        return self._gram_sum

    @property
    def _task_alpha(self) -> float:
        """The current task's α: its batches', or `teacher_alpha` where this process saw none."""
        return self.teacher_alpha if self._alpha is None else self._alpha

    def _reset_task(self) -> None:
        d, kw = self.dim, {"dtype": self.dtype, "device": self.device}
        self._w = torch.zeros((), **kw)
        self._count = 0
        self._alpha = None
        self._from_outputs = None
        self._sx_s = torch.zeros(d, **kw)
        self._sx_e = torch.zeros(d, **kw)
        # the d×d sums are allocated once per group and zeroed for each task: a fresh buffer per task
        # is page-faulted in again, which at the fc2 Gram's size costs ~10× the zeroing
        if self._gram is None:
            self._gram = torch.zeros(d, d, **kw)  # its block upper triangle (the blocks below stay zero)
            self._cross = None if self.direct_rhs else torch.zeros(d, d, **kw)
        else:
            for block in upper_blocks(self._gram):
                block.zero_()
            if self._cross is not None:
                self._cross.zero_()
        self._rhs_task = {}
        self._pooled_rows = []

    def expert_outputs_pay(self, tokens: int, alpha: float) -> bool:
        """Whether this group's task of `tokens` weighted tokens takes its right-hand side from the
        expert modules' outputs (`outputs_rhs_pays`). Exact mode only (in fast mode the outputs are
        rounded)."""
        return self.direct_rhs and self.product_dtype is None and outputs_rhs_pays(tokens, self.dim, alpha)

    def accumulate(
        self, x_student: Tensor, x_teacher: Tensor, weights: Tensor, targets: dict[str, LinearTargets] | None = None
    ) -> None:
        """Add one batch: student and teacher inputs (..., d) and token weights (...). With `direct_rhs`
        the task expert's parameters (`targets`) are needed here already."""
        self.accumulate_mixture(x_student, x_teacher, 1.0, weights, targets)

    def accumulate_mixture(
        self,
        x_student: Tensor,
        x_expert: Tensor,
        alpha: float,
        weights: Tensor,
        targets: dict[str, LinearTargets] | None = None,
        expert_outputs: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Add one batch whose teacher input is x_t = (1 − α)·x_student + α·x_expert (..., d), with
        token weights (...); α is the same for every batch of a task. `expert_outputs` (direct
        right-hand sides only): module → the expert module's output on x_expert (..., n), given
        for every batch of a task or for none."""
        if self._alpha is None:
            self._alpha = float(alpha)
        elif self._alpha != float(alpha):
            raise ValueError(f"modules {list(self.modules)}: one task's batches must share α")
        from_outputs = expert_outputs is not None
        if from_outputs and not self.direct_rhs:
            raise ValueError(f"modules {list(self.modules)}: expert outputs serve direct right-hand sides only")
        if self._from_outputs is None:
            self._from_outputs = from_outputs
        elif self._from_outputs != from_outputs:
            raise ValueError(
                f"modules {list(self.modules)}: one task's batches must all bring the expert's outputs, or none"
            )
        device_type = torch.device(self.device).type
        # the sums' products in the dtypes chosen here, also when the caller holds fast mode's autocast
        off = (
            torch.autocast(device_type, enabled=False)
            if torch.is_autocast_enabled(device_type)
            else contextlib.nullcontext()
        )
        with off:
            if self.main_from is None:
                self._add_batch(x_student, x_expert, alpha, weights, targets, expert_outputs)
            if self.pooled is not None:
                self._keep_pooled_rows(x_student, x_expert, weights, expert_outputs)

    def _keep_pooled_rows(
        self, x_student: Tensor, x_expert: Tensor, weights: Tensor, expert_outputs: Mapping[str, Tensor] | None
    ) -> None:
        """Copies of the pooled token's rows of one batch (copies: a view would keep the whole
        batch's memory from being reused)."""
        assert self.pooled is not None  # only a pooled group keeps rows
        index = self.pooled.token_index

        def rows(t: Tensor) -> Tensor:
            return t[:, index].clone(memory_format=torch.contiguous_format)

        outputs = None if expert_outputs is None else {name: rows(y) for name, y in expert_outputs.items()}
        self._pooled_rows.append((rows(x_student), rows(x_expert), rows(weights), outputs))

    def _fold_pooled_rows(self, targets: dict[str, LinearTargets]) -> None:
        """The task's sums under the pooled weighting, in place: o·(the sums over every token, this
        group's own or `main_from`'s) + (1 − o)·(the sums over the pooled rows)."""
        assert self.pooled is not None and self._gram is not None  # a pooled group; its sums are allocated
        if self.main_from is not None:
            self._take_sums(self.main_from)
        other = self.pooled.other_weight
        count = self._count
        for total in (self._w, self._sx_s, self._sx_e, *upper_blocks(self._gram), *self._rhs_task.values()):
            total.mul_(other)
        if self._cross is not None:
            self._cross.mul_(other)
        rows, self._pooled_rows = self._pooled_rows, []
        if rows and other != 1.0:
            x_s, x_e, w = (torch.cat([r[i] for r in rows]) for i in range(3))  # type: ignore[misc]
            kept = [r[3] for r in rows]
            outputs = None
            if kept[0] is not None:
                outputs = {name: torch.cat([y[name] for y in kept if y is not None]) for name in kept[0]}
            self._add_batch(x_s, x_e, self._task_alpha, w * (1.0 - other), targets, outputs)
        # the tokens with non-zero weight: every token's, unless only the pooled ones weigh
        self._count = count if other != 0.0 else self._count - count

    def _take_sums(self, main: LinearGroupStatistics) -> None:
        """This task's running sums set to those of `main`, a group of the same input and layout."""
        self._w.copy_(main._w)
        self._count = main._count
        self._sx_s.copy_(main._sx_s)
        self._sx_e.copy_(main._sx_e)
        assert self._gram is not None and main._gram is not None  # allocated with each group
        for mine, theirs in zip(upper_blocks(self._gram), upper_blocks(main._gram), strict=True):
            mine.copy_(theirs)
        if self._cross is not None and main._cross is not None:
            self._cross.copy_(main._cross)

    def _add_batch(
        self,
        x_student: Tensor,
        x_expert: Tensor,
        alpha: float,
        weights: Tensor,
        targets: dict[str, LinearTargets] | None,
        expert_outputs: Mapping[str, Tensor] | None,
    ) -> None:
        from_outputs = expert_outputs is not None
        x_s, w = flatten_tokens(x_student, weights)
        x_e, _ = flatten_tokens(x_expert, weights)
        x_s = x_s.to(self.dtype)
        x_e = x_e.to(self.dtype)
        w = w.to(self.dtype)
        # unit weights (no padding, no pooled-token weighting) need no weighted copy of the features
        unit = bool((w == 1).all())
        weighted = x_s if unit else x_s * w[:, None]
        # fast mode's low-precision factors only where their products are faster (`_kernels.gemm`);
        # elsewhere float32 products of the same captured features
        low = self.product_dtype
        if low is not None and not low_precision_products_pay(low, torch.device(self.device)):
            low = None
        self._w += w.sum()
        self._count += int(w.numel())
        self._sx_s += weighted.sum(0)
        self._sx_e.addmv_(x_e.T, w)
        if self.direct_rhs and not from_outputs:
            if targets is None:
                raise ValueError("direct right-hand-side accumulation needs the expert's parameters")
            x_t = torch.lerp(x_s, x_e, alpha, out=self._teacher_rows(x_s.shape[0]))
        if low is not None:  # fast mode: the Gram's factors cast once per batch, not once per block
            # (x_e enters one product at most, the cross moment's, which casts it)
            x_s = x_s.to(low)
            weighted = x_s if unit else weighted.to(low)
        add_upper_gram(self._gram, weighted, x_s, low)
        if self.direct_rhs:
            for name in self.modules:
                if from_outputs:  # Σ w·x_s y_eᵀ (the rest is folded in at task end)
                    if alpha == 0.0:
                        continue
                    y = flatten_tokens(expert_outputs[name], weights)[0].to(self.dtype)
                else:
                    w_i = targets[name].weight.to(device=self.device, dtype=self.dtype)
                    y = product(x_t, w_i.T, low) if low is not None else linear_product(x_t, w_i)
                if name not in self._rhs_task:
                    self._rhs_task[name] = self._rhs_buffer(name, y.shape[1])
                product(weighted.T, y, low, out=self._rhs_task[name])
        elif alpha != 0.0:
            product(weighted.T, x_e, low, out=self._cross)

    def _teacher_rows(self, rows: int) -> Tensor | None:
        """A (rows, dim) scratch matrix for a batch's teacher inputs, reused by the next batches, on
        the CPU; None on an accelerator, whose caching allocator already reuses freed memory (a
        scratch kept there would only add one activation to the peak)."""
        if torch.device(self.device).type != "cpu":
            return None
        if self._teacher is None or self._teacher.shape[0] < rows:
            self._teacher = torch.empty(rows, self.dim, dtype=self.dtype, device=self.device)
        return self._teacher[:rows]

    def _rhs_buffer(self, name: str, outputs: int) -> Tensor:
        """A zeroed (dim, outputs) matrix for the task's right-hand-side sum of module `name`."""
        buffer = self._rhs_buffers.get(name)
        if buffer is None or buffer.shape[1] != outputs:
            buffer = self._rhs_buffers[name] = torch.zeros(self.dim, outputs, dtype=self.dtype, device=self.device)
        else:
            buffer.zero_()
        return buffer

    def _rhs_from_outputs(self, targets: dict[str, LinearTargets], alpha: float) -> None:
        """Σ w·x_s (W_i x_t)ᵀ = (1 − α)·(Σ w·x_s x_sᵀ) W_iᵀ + α·(Σ w·x_s y_eᵀ − (Σ w·x_s) b_iᵀ) for every
        module, from this process's raw sums: the same quantity the projected path accumulates, so
        processes may have taken either path before their sums are reduced."""
        for name in self.modules:
            expert = targets[name]
            if alpha == 1.0:  # the teacher is the expert: no student term (the task's own sum, corrected in place)
                rhs = self._rhs_task[name]
            else:
                w_i = expert.weight.to(device=self.device, dtype=self.dtype)
                rhs = symmetric_upper_product(self._gram, w_i.T).mul_(1.0 - alpha)
                if alpha != 0.0:
                    rhs.add_(self._rhs_task[name], alpha=alpha)
            if alpha != 0.0 and expert.bias is not None:
                rhs.addr_(self._sx_s, expert.bias.to(device=self.device, dtype=self.dtype), alpha=-alpha)
            self._rhs_task[name] = rhs

    def finish_task(  # noqa: C901 - the fold's optional parts (bias, norms, direct RHS) are each one branch
        self, targets: dict[str, LinearTargets], reduce: SumReducer = _identity_reducer, task_weight: float = 1.0
    ) -> None:
        """Fold the current task into the task sums, using the task's expert parameters. `task_weight` ω_i
        (`FeatCalConfig.normalised_task_weights`) multiplies the task's every term: its scale s_i
        becomes ω_i·s_i in Σ s_i C_i, Σ s_i X_i W_iᵀ, Σ s_i and the bias sums (applied after `reduce`,
        so every process folds the same weighted sums)."""
        if self.pooled is not None:
            self._fold_pooled_rows(targets)
        alpha = self._task_alpha
        count = torch.tensor(float(self._count), dtype=self.dtype, device=self.device)
        mirror_diagonal_blocks_(self._gram)  # (syrk left their lower halves out)
        if self.direct_rhs and self._from_outputs:
            self._rhs_from_outputs(targets, alpha)
        if self.direct_rhs:
            for name in self.modules:  # a process without batches of this task contributes zeros
                if name not in self._rhs_task:
                    self._rhs_task[name] = torch.zeros(
                        self.dim, targets[name].weight.shape[0], dtype=self.dtype, device=self.device
                    )
            moments = [self._rhs_task[name] for name in self.modules]
        elif alpha != 0.0:
            moments = [self._cross]
        else:
            moments = []
        w, sx_s, sx_e, gram, count, *moments = reduce([self._w, self._sx_s, self._sx_e, self._gram, count, *moments])
        total = float(w)
        if total <= 0:
            raise ValueError(f"modules {list(self.modules)}: the task has no token with non-zero weight")
        # `gram` holds the block upper triangle of the raw sum total·C_i: the means are never formed,
        # each sum enters the task sums scaled by s_i / total in the pass that adds it
        s_i = task_scale(upper_gram_norm(gram) / total, self.epsilon)
        self.task_scales.append(s_i)
        if task_weight != 1.0:  # (a weight of 1 leaves the arithmetic exactly as without weights)
            s_i *= task_weight
        scale = s_i / total
        mu_s, mu_e = sx_s / total, sx_e / total
        mu_t = torch.lerp(mu_s, mu_e, alpha)
        cross = None
        if not self.direct_rhs:  # s_i·X_i = s_i·E_w[x_s x_tᵀ] = scale·((1 − α)·total·C_i + α·Σw·x_s x_eᵀ)
            if alpha == 1.0:
                cross = moments[0].mul_(scale)
            else:
                cross = symmetric_from_upper(gram)
                if alpha != 0.0:
                    cross.lerp_(moments[0], alpha)
                cross.mul_(scale)
        self.weighted_tokens += int(count)
        self.effective_tokens += total
        if self._gram_sum_upper is None:
            self._gram_sum_upper = gram.mul(scale)
        else:
            for acc, block in zip(upper_blocks(self._gram_sum_upper), upper_blocks(gram), strict=True):
                acc.add_(block, alpha=scale)
        self._gram_sum = None
        self.student_mean_sum = (
            s_i * mu_s if self.student_mean_sum is None else self.student_mean_sum.add_(mu_s, alpha=s_i)
        )
        self.scale_sum += s_i
        for index, name in enumerate(self.modules):
            expert = targets[name]
            w_i = expert.weight.to(device=self.device, dtype=self.dtype)
            # s_i · X_i W_iᵀ, with X_i = E_w[x_s x_tᵀ] (or its product with W_iᵀ accumulated directly),
            # added into the task sum in place
            if name not in self.rhs_sum:
                self.rhs_sum[name] = moments[index].mul(scale) if self.direct_rhs else cross @ w_i.T
            elif self.direct_rhs:
                self.rhs_sum[name].add_(moments[index], alpha=scale)
            else:
                self.rhs_sum[name].addmm_(cross, w_i.T)
            target = w_i @ mu_t
            if expert.bias is not None:
                target = target + expert.bias.to(device=self.device, dtype=self.dtype)
            self.bias_target_sum[name] = (
                s_i * target if name not in self.bias_target_sum else self.bias_target_sum[name].add_(target, alpha=s_i)
            )
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
    #: Σ ω_i over the finished tasks, the T of the method's 2×2 system (the number of tasks when unweighted)
    task_weight_sum: float = field(init=False, default=0.0)
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
        if self.centered:  # LayerNorm's own kernel without the affine: one pass instead of five
            return torch.native_layer_norm(x, (x.shape[-1],), None, None, self.norm_eps)[0]
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)

    def accumulate(self, x_student: Tensor, weights: Tensor) -> None:
        """Add one batch of the norm's student-side inputs (..., d) with token weights (...)."""
        x, w = flatten_tokens(x_student, weights)
        z = self.normalise(x)
        w = w.to(self.dtype)[:, None]
        self._w += w.sum()
        self._count += int(w.numel())
        # z is `normalise`'s own new tensor: squared (and weighted) in place
        if bool((w == 1).all()):  # unit weights: w·z is z itself, no weighted copy needed
            self._sz += z.sum(0)
            self._sz2 += z.square_().sum(0)
        else:  # (one weighted copy: with a copy of z² as well this took ~9× as long for 800 × 768)
            self._sz += (w * z).sum(0)
            self._sz2 += z.square_().mul_(w).sum(0)

    def finish_task(
        self, gamma: Tensor, beta: Tensor | None, reduce: SumReducer = _identity_reducer, task_weight: float = 1.0
    ) -> None:
        """Fold the current task, given the task expert's (γ_i, β_i). `task_weight` ω_i multiplies the
        task's terms: e_i, m_i, both right-hand sides and its count in T (applied after `reduce`)."""
        count = torch.tensor(float(self._count), dtype=self.dtype, device=self.device)
        w, sz, sz2, count = reduce([self._w, self._sz, self._sz2, count])
        total = float(w)
        if total <= 0:
            raise ValueError(f"module {self.name}: the task has no token with non-zero weight")
        m_i, e_i = sz / total, sz2 / total
        if task_weight != 1.0:  # every term of the task is linear in (e_i, m_i) but β_i's, weighted below
            m_i, e_i = m_i * task_weight, e_i * task_weight
        g_i = gamma.to(device=self.device, dtype=self.dtype)
        b_i = None if beta is None else beta.to(device=self.device, dtype=self.dtype)
        gamma_target = e_i * g_i if b_i is None else e_i * g_i + m_i * b_i
        beta_target = None if b_i is None else m_i * g_i + b_i * task_weight

        def add(acc: Tensor | None, value: Tensor | None) -> Tensor | None:
            if value is None:
                return None
            return value.clone() if acc is None else acc.add_(value)

        self.second_moment_sum = add(self.second_moment_sum, e_i)
        self.mean_sum = add(self.mean_sum, m_i)
        self.gamma_target_sum = add(self.gamma_target_sum, gamma_target)
        self.beta_target_sum = add(self.beta_target_sum, beta_target)
        self.num_tasks += 1
        self.task_weight_sum += task_weight
        self.weighted_tokens += int(count)
        self._reset_task()
