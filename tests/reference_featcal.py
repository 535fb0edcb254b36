"""An independent, deliberately naive FeatCal for CLIP vision towers, written straight from
the method specification (the project's method notes; its formulas are in docs/how-featcal-works.md)
for the tests: float64 throughout, every example of a task in one tensor, one
module at a time (no shared statistics), `torch.nn.functional.layer_norm` for the normalised input
and `torch.linalg.solve` for every system. Slow but obviously right; the library must agree with it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def _tower(model):
    return getattr(model, "vision_model", model)


def _inputs(tower, pixel_values):
    return tower.pre_layrnorm(tower.embeddings(pixel_values))


def _module_inputs(block, hidden):
    store = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, _n=n: store.__setitem__(_n, args[0]))
        for n, m in block.named_modules()
        if isinstance(m, (nn.Linear, nn.LayerNorm))
    ]
    out = block(hidden, None)
    for h in handles:
        h.remove()
    return store, out


def reference_featcal(merged, base, experts, data, *, lam=0.05, rho=2.2, alpha=0.25, last_weight=0.01, eps=1e-8,
                      task_weights=None):
    """Return the calibrated merged model (float64 copy) and its per-block drift before/after.

    `data` maps task → list of pixel_values tensors (all used). `task_weights`: task → w_i (1 if not
    named); every term of task i is multiplied by ω_i = w_i·T / Σ_j w_j (mean 1), T in the norms' 2×2
    system becoming Σ ω_i.
    """
    merged = copy.deepcopy(merged).double().eval()
    base = None if base is None else copy.deepcopy(base).double().eval()
    experts = {t: copy.deepcopy(e).double().eval() for t, e in experts.items()}
    tasks = list(experts)
    raw = {t: float((task_weights or {}).get(t, 1.0)) for t in tasks}
    omega = {t: raw[t] * len(tasks) / sum(raw.values()) for t in tasks}
    pixels = {t: torch.cat(data[t]).double() for t in tasks}
    m_tower = _tower(merged)
    with torch.no_grad():
        h_s = {t: _inputs(m_tower, pixels[t]) for t in tasks}
        h_e = {t: _inputs(_tower(experts[t]), pixels[t]) for t in tasks}
        h_g = {t: h_s[t].clone() for t in tasks}  # merged model as given
        layers = m_tower.encoder.layers
        drift = {t: {"before": [], "after": []} for t in tasks}
        for idx, block in enumerate(layers):
            last = idx == len(layers) - 1
            xs, xe, out_e = {}, {}, {}
            for t in tasks:
                xs[t], _ = _module_inputs(block, h_s[t])
                xe[t], out_e[t] = _module_inputs(_tower(experts[t]).encoder.layers[idx], h_e[t])
            new_given = {t: block(h_g[t], None) for t in tasks}
            updates = {}
            for name, module in block.named_modules():
                if not isinstance(module, (nn.Linear, nn.LayerNorm)):
                    continue
                weighted = last and name not in ("self_attn.k_proj", "self_attn.v_proj")

                def anchor_of(attr, module=module, idx=idx, name=name):
                    m = getattr(module, attr)
                    if base is None:
                        return m.clone()
                    b = getattr(_tower(base).encoder.layers[idx].get_submodule(name), attr)
                    return b + rho * (m - b)

                if isinstance(module, nn.Linear):
                    d = module.in_features
                    lhs = torch.zeros(d, d, dtype=torch.float64)
                    rhs = torch.zeros(d, module.out_features, dtype=torch.float64)
                    bias_num = torch.zeros(module.out_features, dtype=torch.float64)
                    s_sum = 0.0
                    per_task = []
                    for t in tasks:
                        x_s = xs[t][name].reshape(-1, d)
                        x_t = alpha * xe[t][name].reshape(-1, d) + (1 - alpha) * x_s
                        w = torch.ones(xs[t][name].shape[:2], dtype=torch.float64)
                        if weighted:
                            w[:, 1:] = last_weight
                        w = w.reshape(-1)
                        wn = w / w.sum()
                        c = (x_s * wn[:, None]).T @ x_s
                        x = (x_s * wn[:, None]).T @ x_t
                        s = omega[t] / max(torch.linalg.norm(c).item(), eps)
                        e_mod = _tower(experts[t]).encoder.layers[idx].get_submodule(name)
                        lhs += s * c
                        rhs += s * x @ e_mod.weight.T
                        s_sum += s
                        per_task.append((s, wn @ x_s, wn @ x_t, e_mod))
                    a_w = anchor_of("weight")
                    weight = torch.linalg.solve(lhs + (lam + eps) * torch.eye(d, dtype=torch.float64),
                                                rhs + lam * a_w.T).T
                    for s, mu_s, mu_t, e_mod in per_task:
                        bias_num += s * (e_mod.bias + e_mod.weight @ mu_t - weight @ mu_s)
                    bias = (bias_num + lam * anchor_of("bias")) / (s_sum + lam)
                    updates[name] = (weight, bias)
                else:
                    d = module.normalized_shape[0]
                    a = torch.zeros(d, 2, 2, dtype=torch.float64)
                    r = torch.zeros(d, 2, dtype=torch.float64)
                    for t in tasks:
                        z = F.layer_norm(xs[t][name], (d,), eps=module.eps).reshape(-1, d)
                        w = torch.ones(xs[t][name].shape[:2], dtype=torch.float64)
                        if weighted:
                            w[:, 1:] = last_weight
                        wn = (w / w.sum()).reshape(-1)
                        m_i = wn @ z
                        e_i = wn @ z.square()
                        e_mod = _tower(experts[t]).encoder.layers[idx].get_submodule(name)
                        o = omega[t]
                        a[:, 0, 0] += o * e_i
                        a[:, 0, 1] += o * m_i
                        a[:, 1, 0] += o * m_i
                        a[:, 1, 1] += o
                        r[:, 0] += o * (e_i * e_mod.weight + m_i * e_mod.bias)
                        r[:, 1] += o * (m_i * e_mod.weight + e_mod.bias)
                    a[:, 0, 0] += lam
                    a[:, 1, 1] += lam
                    r[:, 0] += lam * anchor_of("weight")
                    r[:, 1] += lam * anchor_of("bias")
                    sol = torch.linalg.solve(a, r)
                    updates[name] = (sol[:, 0], sol[:, 1])
            for name, (weight, bias) in updates.items():
                module = block.get_submodule(name)
                module.weight.copy_(weight)
                module.bias.copy_(bias)
            for t in tasks:
                h_s[t] = block(h_s[t], None)
                h_e[t] = out_e[t]
                h_g[t] = new_given[t]
                drift[t]["before"].append((h_g[t] - h_e[t]).norm(dim=-1).mean().item())
                drift[t]["after"].append((h_s[t] - h_e[t]).norm(dim=-1).mean().item())
    return merged, drift
