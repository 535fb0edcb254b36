"""An independent, deliberately naive FeatCal for any transformers model whose blocks hold Linears,
LayerNorms and RMS norms, written straight from the method specification (the project's method notes;
its formulas are in docs/how-featcal-works.md) for the tests.

It shares nothing with hf_featcal (no import of it): the streams come from *full-model forwards*
with forward pre-hooks on the modules of the block being calibrated. Because the blocks before ℓ
have already been written, the merged model's own forward hands block ℓ exactly the student
stream (its own embeddings, masks, position biases, rotary embeddings and, in a T5 decoder, its own
calibrated encoder's output); expert i's forward hands it the expert stream. Float64 throughout,
every token of a task in one tensor, one module at a time (no shared statistics), and
`torch.linalg.solve` for every system. Slow, but obviously right.

A family is described by a `FamilySpec`: the blocks in forward order, how to run the model on a
batch, and the token weights of each module's input.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

#: weights(block_position, module_name, batch, input) → token weights shaped like input.shape[:-1]
WeightsFn = Callable[[int, str, dict, Tensor], Tensor]


@dataclass
class FamilySpec:
    blocks: Callable[[nn.Module], list[nn.Module]]  # every calibrated block, in forward order
    forward: Callable[[nn.Module, dict], None]  # one full forward on a batch
    weights: WeightsFn


def _is_rms_norm(module: nn.Module) -> bool:
    """A scale-only norm (T5LayerNorm, LlamaRMSNorm, ...): a 1-D weight, no bias, named like a norm."""
    weight = getattr(module, "weight", None)
    return (
        "Norm" in type(module).__name__
        and not isinstance(module, nn.LayerNorm)
        and isinstance(weight, nn.Parameter)
        and weight.ndim == 1
        and getattr(module, "bias", None) is None
    )


def _rms_eps(module: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    raise AttributeError(f"no epsilon on {type(module).__name__}")


def calibrated_modules(block: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m
        for name, m in block.named_modules()
        if isinstance(m, (nn.Linear, nn.LayerNorm)) or _is_rms_norm(m)
    }


def _capture(
    model: nn.Module, spec: FamilySpec, position: int, batches: list[dict]
) -> dict[str, tuple[Tensor, Tensor]]:
    """Inputs of every calibrated module of block `position` over all `batches`, as (rows × d, weights)."""
    block = spec.blocks(model)[position]
    modules = calibrated_modules(block)
    rows: dict[str, list[Tensor]] = {n: [] for n in modules}
    weights: dict[str, list[Tensor]] = {n: [] for n in modules}
    for batch in batches:
        seen: dict[str, Tensor] = {}

        def hook(mod, args, _name=None, seen=seen):
            assert _name not in seen, f"{_name} called twice in one forward"
            seen[_name] = args[0].detach().double()

        handles = [m.register_forward_pre_hook(lambda mod, args, _n=n: hook(mod, args, _n)) for n, m in modules.items()]
        try:
            with torch.no_grad():
                spec.forward(model, batch)
        finally:
            for h in handles:
                h.remove()
        for name, x in seen.items():
            w = spec.weights(position, name, batch, x).double()
            while w.ndim < x.ndim - 1:  # a per-head input (Qwen3's q/k norms): every head of a token
                w = w[..., None].expand(*w.shape, x.shape[w.ndim])
            assert w.shape == x.shape[:-1], (name, w.shape, x.shape)
            keep = w.reshape(-1) > 0  # select, don't multiply: padded positions may hold anything
            rows[name].append(x.reshape(-1, x.shape[-1])[keep])
            weights[name].append(w.reshape(-1)[keep])
    return {n: (torch.cat(rows[n]), torch.cat(weights[n])) for n in modules if rows[n]}


def reference_featcal(
    merged: nn.Module,
    base: nn.Module | None,
    experts: dict[str, nn.Module],
    data: dict[str, list[dict]],
    spec: FamilySpec,
    *,
    lam: float = 0.05,
    rho: float = 2.2,
    alpha: float = 0.25,
    eps: float = 1e-8,
) -> nn.Module:
    """The calibrated merged model (a float64 copy); the inputs are left as they are."""
    merged = copy.deepcopy(merged).double().eval()
    base = None if base is None else copy.deepcopy(base).double().eval()
    experts = {t: copy.deepcopy(e).double().eval() for t, e in experts.items()}
    tasks = list(experts)
    with torch.no_grad():
        for position, block in enumerate(spec.blocks(merged)):
            student = {t: _capture(merged, spec, position, data[t]) for t in tasks}
            expert_side = {t: _capture(experts[t], spec, position, data[t]) for t in tasks}
            updates: dict[str, dict[str, Tensor]] = {}
            for name, module in calibrated_modules(block).items():
                def anchor(attr: str, module: nn.Module = module, name: str = name, position: int = position) -> Tensor:
                    value = getattr(module, attr)
                    if base is None:
                        return value.clone()
                    b = getattr(spec.blocks(base)[position].get_submodule(name), attr)
                    return b + rho * (value - b)

                def expert_module(t: str, name: str = name, position: int = position) -> nn.Module:
                    return spec.blocks(experts[t])[position].get_submodule(name)

                if isinstance(module, nn.Linear):
                    d = module.in_features
                    lhs = torch.zeros(d, d, dtype=torch.float64)
                    rhs = torch.zeros(d, module.out_features, dtype=torch.float64)
                    per_task = []
                    for t in tasks:
                        x_s, w = student[t][name]
                        x_e, w_e = expert_side[t][name]
                        assert torch.equal(w, w_e)
                        x_t = alpha * x_e + (1 - alpha) * x_s
                        wn = w / w.sum()
                        c = (x_s * wn[:, None]).T @ x_s
                        x = (x_s * wn[:, None]).T @ x_t
                        s = 1.0 / max(torch.linalg.norm(c).item(), eps)
                        lhs += s * c
                        rhs += s * x @ expert_module(t).weight.T
                        per_task.append((s, wn @ x_s, wn @ x_t, expert_module(t)))
                    weight = torch.linalg.solve(
                        lhs + (lam + eps) * torch.eye(d, dtype=torch.float64), rhs + lam * anchor("weight").T
                    ).T
                    updates[name] = {"weight": weight}
                    if module.bias is not None:
                        numerator = lam * anchor("bias")
                        for s, mu_s, mu_t, e_mod in per_task:
                            numerator = numerator + s * (e_mod.bias + e_mod.weight @ mu_t - weight @ mu_s)
                        updates[name]["bias"] = numerator / (sum(p[0] for p in per_task) + lam)
                elif isinstance(module, nn.LayerNorm):
                    d = module.normalized_shape[0]
                    a = torch.zeros(d, 2, 2, dtype=torch.float64)
                    r = torch.zeros(d, 2, dtype=torch.float64)
                    for t in tasks:
                        x_s, w = student[t][name]
                        z = (x_s - x_s.mean(-1, keepdim=True)) / torch.sqrt(
                            x_s.var(-1, unbiased=False, keepdim=True) + module.eps
                        )
                        wn = w / w.sum()
                        m_i, e_i = wn @ z, wn @ z.square()
                        e_mod = expert_module(t)
                        a[:, 0, 0] += e_i
                        a[:, 0, 1] += m_i
                        a[:, 1, 0] += m_i
                        a[:, 1, 1] += 1.0
                        r[:, 0] += e_i * e_mod.weight + m_i * e_mod.bias
                        r[:, 1] += m_i * e_mod.weight + e_mod.bias
                    a[:, 0, 0] += lam
                    a[:, 1, 1] += lam
                    r[:, 0] += lam * anchor("weight")
                    r[:, 1] += lam * anchor("bias")
                    solution = torch.linalg.solve(a, r)
                    updates[name] = {"weight": solution[:, 0], "bias": solution[:, 1]}
                else:  # RMS norm: γ = (Σ e_i γ_i + λ A) / (Σ e_i + λ)
                    numerator = lam * anchor("weight")
                    denominator = torch.full_like(numerator, lam)
                    for t in tasks:
                        x_s, w = student[t][name]
                        z = x_s * torch.rsqrt(x_s.square().mean(-1, keepdim=True) + _rms_eps(module))
                        e_i = (w / w.sum()) @ z.square()
                        numerator = numerator + e_i * expert_module(t).weight
                        denominator = denominator + e_i
                    updates[name] = {"weight": numerator / denominator}
            for name, values in updates.items():
                module = block.get_submodule(name)
                for attr, value in values.items():
                    getattr(module, attr).copy_(value)
    return merged


# ----------------------------------------------------------------------------- family descriptions
def _padding(batch: dict, key: str | None, x: Tensor) -> Tensor:
    mask = None if key is None else batch.get(key)
    if mask is None:
        return torch.ones(x.shape[:-1], dtype=torch.float64)
    return mask.double()


_T5_CROSS_KEY_VALUE = ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")


def t5_spec(model: nn.Module) -> FamilySpec:
    """T5ForConditionalGeneration teacher-forced on `labels`: its encoder blocks, then its decoder
    blocks. Encoder tokens weigh by `attention_mask`; decoder tokens by `labels != -100`; the
    cross-attention keys/values read the encoder output, so they weigh by the encoder mask."""
    num_encoder = len(model.encoder.block)

    def blocks(m):
        return list(m.encoder.block) + list(m.decoder.block)

    def forward(m, batch):
        m(**batch, use_cache=False)

    def weights(position, name, batch, x):
        if position < num_encoder or name in _T5_CROSS_KEY_VALUE:
            return _padding(batch, "attention_mask", x)
        return (batch["labels"] != -100).double()

    return FamilySpec(blocks, forward, weights)


def causal_lm_spec(model: nn.Module) -> FamilySpec:
    """Llama-family `*ForCausalLM`: one stack; every non-padding token weighs 1."""

    def blocks(m):
        return list(m.model.layers)

    def forward(m, batch):
        m(**batch, use_cache=False)

    def weights(position, name, batch, x):
        return _padding(batch, "attention_mask", x)

    return FamilySpec(blocks, forward, weights)


def pooled_encoder_spec(
    model: nn.Module,
    blocks: Callable[[nn.Module], list[nn.Module]],
    key_value: tuple[str, ...],
    *,
    mask_key: str | None = "attention_mask",
    final_block_token_weight: float = 0.01,
) -> FamilySpec:
    """An encoder whose head reads token 0 (BERT, ViT): in the last block every module but the
    key/value projections gives the other tokens `final_block_token_weight`."""
    last = len(blocks(model)) - 1

    def forward(m, batch):
        m(**batch)

    def weights(position, name, batch, x):
        w = _padding(batch, mask_key, x)
        if position == last and name not in key_value:
            w = w.clone()
            w[:, 1:] *= final_block_token_weight
        return w

    return FamilySpec(blocks, forward, weights)
