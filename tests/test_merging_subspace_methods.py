"""The data-free subspace merges TSV-M, Iso-C and Iso-CTS (`hf_featcal.merging.methods.tsv_m`, `iso_c`,
`iso_cts`), checked against float64 references written here from the papers' formulas: plain loops over
the state dicts, the orthonormal bases taken by whitening, ``A (AᵀA)^(-1/2)`` (the TSV paper's form of
the orthogonalisation), not by the SVD the library uses; on a tiny CLIP vision tower and a tiny Llama
whose experts differ from the base in every tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CLIPVisionModel, LlamaConfig, LlamaForCausalLM

from hf_featcal import cli
from hf_featcal.merging import merge_models
from hf_featcal.merging.engine import Expert
from hf_featcal.merging.methods.iso_cts import subspace_sizes
from testing_utils import perturbed, tiny_vision_config

METHODS = ("tsv_m", "iso_c", "iso_cts")


# ------------------------------------------------------------------------------------------ references (float64)
def _inverse_sqrt(gram: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(gram)
    return vectors @ torch.diag(values.rsqrt()) @ vectors.T


def _orthonormal_columns(a: torch.Tensor) -> torch.Tensor:
    return a @ _inverse_sqrt(a.T @ a)


def _orthonormal_rows(a: torch.Tensor) -> torch.Tensor:
    return _inverse_sqrt(a @ a.T) @ a


def _top(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :k], s[:k], vh[:k]


def _tsv_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
    """TSV-M (Gargiulo et al. 2025): each task's top r/T singular triplets, the concatenated bases
    orthonormalised, Σ_i U⊥_i S_i V⊥_iᵀ."""
    k = min(taus[0].shape) // len(taus)
    parts = [_top(tau, k) for tau in taus]
    u = _orthonormal_columns(torch.cat([p[0] for p in parts], dim=1))
    vh = _orthonormal_rows(torch.cat([p[2] for p in parts], dim=0))
    s = torch.cat([p[1] for p in parts])
    return sum(u[:, i * k:(i + 1) * k] @ torch.diag(s[i * k:(i + 1) * k]) @ vh[i * k:(i + 1) * k]
               for i in range(len(taus)))


def _iso_c_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
    """Iso-C (Marczak et al. 2025): the summed matrix M with every singular value set to their mean:
    (‖M‖_* / r) · the orthogonal factor of M."""
    total = sum(taus)
    rows, cols = total.shape
    polar = _orthonormal_columns(total) if rows >= cols else _orthonormal_rows(total)
    return torch.linalg.matrix_norm(total, ord="nuc") / min(rows, cols) * polar


def _iso_cts_matrix(taus: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """Iso-CTS (Marczak et al. 2025): the sum's top c directions, each task's top (r − c)/T directions
    of its residual outside them, the bases orthonormalised, the spectrum flattened to its mean."""
    rank, tasks = min(taus[0].shape), len(taus)
    common = int(rank * fraction)
    specific = round((rank - common) / tasks) * tasks
    common = rank - specific
    u_c, s_c, vh_c = _top(sum(taus), common)
    parts = [_top(tau - u_c @ u_c.T @ tau, specific // tasks) for tau in taus]
    u = _orthonormal_columns(torch.cat([u_c, *[p[0] for p in parts]], dim=1))
    vh = _orthonormal_rows(torch.cat([vh_c, *[p[2] for p in parts]], dim=0))
    s = torch.cat([s_c, *[p[1] for p in parts]])
    return u @ vh * s.mean()


def _reference(method: str, base: torch.nn.Module, experts: dict, alpha: float, fraction: float = 0.8) -> dict:
    """θ_0 + α·Δ per floating-point tensor: Δ the method's matrix rule for a 2-D tensor, the mean task
    vector otherwise (both papers, FusionBench)."""
    matrix_rule = {"tsv_m": _tsv_matrix, "iso_c": _iso_c_matrix,
                   "iso_cts": lambda taus: _iso_cts_matrix(taus, fraction)}[method]
    expert_states = [e.state_dict() for e in experts.values()]
    merged = {}
    for key, theta0 in base.state_dict().items():
        theta0 = theta0.double()
        taus = [state[key].double() - theta0 for state in expert_states]
        delta = matrix_rule(taus) if theta0.dim() == 2 else sum(taus) / len(taus)
        merged[key] = theta0 + alpha * delta
    return merged


# ------------------------------------------------------------------------------------------ models
def _clip_setting(tasks: int = 3) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)  # the base's random init
    generator = torch.Generator().manual_seed(0)
    base = CLIPVisionModel(tiny_vision_config()).eval()
    return base, {f"task{i}": perturbed(base, generator, 0.05) for i in range(tasks)}


def _llama_setting(tasks: int = 2) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    return base, {f"task{i}": perturbed(base, generator, 0.05) for i in range(tasks)}


SETTINGS = {"clip": _clip_setting, "llama": _llama_setting}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize(("method", "params"), [
    ("tsv_m", {}), ("tsv_m", {"scaling_factor": 0.7}),
    ("iso_c", {}), ("iso_c", {"scaling_factor": 1.3}),
    ("iso_cts", {}), ("iso_cts", {"scaling_factor": 1.3, "common_space_fraction": 0.5}),
])
def test_merge_matches_the_papers_formulas_in_float64(setting, method, params):
    base, experts = SETTINGS[setting]()
    before = {name: {k: v.clone() for k, v in e.state_dict().items()} for name, e in experts.items()}
    merged = merge_models(base, experts, method, **params).state_dict()
    alpha = params.get("scaling_factor", 1.0)
    want = _reference(method, base, experts, alpha, params.get("common_space_fraction", 0.8))
    assert merged.keys() == want.keys()
    for key, value in want.items():
        # float32 SVDs against float64, |Δ| ~ 0.2: off by up to 1.2e-5 where a cut falls between close
        # singular values (gap ~0.01; FusionBench's float32 is as far off); a slip in a formula moves it by > 0.1
        torch.testing.assert_close(merged[key].double(), value, rtol=0, atol=5e-5, msg=key)
    for name, expert in experts.items():  # the caller's experts are untouched
        assert all(torch.equal(v, before[name][k]) for k, v in expert.state_dict().items())


@pytest.mark.parametrize("method", METHODS)
def test_every_tensor_moves_and_only_the_matrices_leave_the_mean(method):
    """Every tensor of the base changes; the non-2-D ones are θ_0 + α·mean(τ_i), the 2-D ones are not."""
    base, experts = _clip_setting()
    merged = merge_models(base, experts, method).state_dict()
    states = [e.state_dict() for e in experts.values()]
    off_the_mean = set()
    for key, theta0 in base.state_dict().items():
        assert not torch.equal(merged[key], theta0), key
        mean = theta0 + sum(state[key] - theta0 for state in states) / len(states)
        if not torch.allclose(merged[key], mean, rtol=0, atol=1e-6):
            off_the_mean.add(key)
    matrices = {k for k, v in base.state_dict().items() if v.dim() == 2}
    assert off_the_mean == matrices
    assert "embeddings.position_embedding.weight" in matrices and "encoder.layers.0.mlp.fc1.weight" in matrices


def test_tsv_m_of_one_expert_is_that_expert():
    """T = 1: each matrix keeps all its singular triplets, already orthonormal: Task Arithmetic with α."""
    base, experts = _llama_setting(tasks=1)
    merged = merge_models(base, experts, "tsv_m").state_dict()
    for key, value in experts["task0"].state_dict().items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=2e-6, msg=key)


def test_iso_cts_subspace_sizes():
    """(common, per task) from c0 = int(r·f), t = round((r − c0)/T)·T (half to even), c = r − t; t drops by T
    where it would pass r (FusionBench fails there)."""
    assert subspace_sizes(16, 3, 0.8) == (13, 1)  # c0 = 12, round(4/3) = 1
    assert subspace_sizes(768, 8, 0.8) == (616, 19)  # c0 = 614, round(19.25) = 19
    assert subspace_sizes(6, 2, 0.5) == (2, 2)  # round(1.5) = 2
    assert subspace_sizes(10, 4, 0.8) == (10, 0)  # round(0.5) = 0
    assert subspace_sizes(16, 2, 1.0) == (16, 0)  # the whole rank is common: Iso-C
    assert subspace_sizes(5, 8, 0.1) == (5, 0)  # round(5/8)·8 = 8 > 5
    assert subspace_sizes(11, 3, 0.0) == (2, 3)  # round(11/3)·3 = 12 > 11 -> 9


def test_an_expert_lacking_a_tensor_counts_as_a_zero_task_vector():
    from hf_featcal.merging._subspaces import per_tensor_rule

    def unused(key: str) -> torch.Tensor:
        raise AssertionError("the rule reads no tensor")

    a, b = Expert("a", {}, unused), Expert("b", {}, unused)
    seen = []
    rule = per_tensor_rule(["a", "b", "c"], lambda taus: seen.append(taus) or taus[0])
    tau_a, tau_c = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(rule("bias", [(a, tau_a), (Expert("c", {}, unused), tau_c)]), (tau_a + tau_c) / 3)
    matrix = torch.randn(2, 3)
    rule("weight", [(b, matrix)])
    assert [t.shape for t in seen[0]] == [(2, 3)] * 3
    assert torch.equal(seen[0][1], matrix) and not seen[0][0].any() and not seen[0][2].any()


@pytest.mark.parametrize(("method", "params", "named"), [
    ("tsv_m", {"scaling_factor": 1e3}, "`scaling_factor` must be in [-100, 100]"),
    ("iso_c", {"scaling_factor": float("nan")}, "`scaling_factor` must be a finite real number"),
    ("iso_cts", {"common_space_fraction": 1.5}, "`common_space_fraction` must be in [0, 1]"),
    ("iso_cts", {"common_space_fraction": -0.1}, "`common_space_fraction` must be in [0, 1]"),
    ("iso_cts", {"common_space_fraction": True}, "`common_space_fraction` must be a finite real number"),
])
def test_bad_parameters_are_refused_before_any_model_is_read(method, params, named, tmp_path):
    missing = str(tmp_path / "no_such_model")  # reading it would fail with another message
    with pytest.raises(ValueError) as raised:
        merge_models(missing, {"task": missing}, method, **params)
    assert named in str(raised.value)


def test_the_cli_offers_the_methods_and_their_flags(capsys):
    assert cli.main(["merge", "--help"]) == 0
    text = capsys.readouterr().out
    assert all(method in text for method in METHODS) and "--common-space-fraction" in text


# ------------------------------------------------------------------------------------------ low-rank task vectors
def _lora_like_setting(permutation: bool = False) -> tuple[torch.nn.Module, dict, dict]:
    """A tiny Llama and two experts that each move one kind of matrix by a rank-2 product B·A (LoRA's
    form), on disjoint modules: "q" every q_proj, "up" every up_proj; every other tensor is the base's.
    Returns (base, experts, task matrix per key). `permutation`: every model's q_proj and up_proj
    weights with their rows and columns permuted (the same permutation for all models)."""
    base, _ = _llama_setting(tasks=0)
    generator = torch.Generator().manual_seed(3)
    experts, deltas = {}, {}
    for task, module in (("q", "self_attn.q_proj"), ("up", "mlp.up_proj")):
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for name, weight in expert.named_parameters():
                if name.endswith(f"{module}.weight"):
                    delta = 0.2 * torch.randn(weight.shape[0], 2, generator=generator) @ torch.randn(
                        2, weight.shape[1], generator=generator)
                    weight += delta
                    deltas[name] = delta
        experts[task] = expert
    if permutation:
        for model in (base, *experts.values()):
            with torch.no_grad():
                for name in deltas:
                    weight = model.get_parameter(name)
                    weight.copy_(_permuted(weight.detach().clone()))
    return base, experts, deltas


def _permuted(matrix: torch.Tensor) -> torch.Tensor:
    rows = torch.randperm(matrix.shape[0], generator=torch.Generator().manual_seed(matrix.shape[0]))
    cols = torch.randperm(matrix.shape[1], generator=torch.Generator().manual_seed(matrix.shape[1] + 1))
    return matrix[rows][:, cols]


def test_tsv_m_of_low_rank_experts_on_disjoint_modules_is_each_adapters_delta():
    """Each matrix only one expert moved (rank 2) merges to α times that expert's delta: the zero task
    matrix of the other expert and the zero singular values of the moved one bring no direction. The
    same holds with every row and column permuted (null-space directions would not follow)."""
    alpha = 0.7
    for permutation in (False, True):
        base, experts, deltas = _lora_like_setting(permutation)
        merged = merge_models(base, experts, "tsv_m", scaling_factor=alpha).state_dict()
        base_state = base.state_dict()
        for key, delta in deltas.items():
            want = alpha * (_permuted(delta) if permutation else delta)
            torch.testing.assert_close(merged[key] - base_state[key], want, rtol=0, atol=2e-6, msg=key)
        for key, value in base_state.items():  # no expert moved anything else
            if key not in deltas:
                assert torch.equal(merged[key], value), key


@pytest.mark.parametrize("method", ["iso_c", "iso_cts"])
def test_isotropic_merges_of_low_rank_experts_follow_a_permutation_of_rows_and_columns(method):
    """Iso-C / Iso-CTS on rank-2 task matrices: each matrix is the flat spectrum over its nonzero singular
    values only, so (a) the merge of the permuted models is the permuted merge, and (b) each matrix is
    mean(σ) · U Vᵀ of its one expert's delta (float64 reference), not spread over arbitrary null directions."""
    base, experts, deltas = _lora_like_setting()
    merged = merge_models(base, experts, method).state_dict()
    p_base, p_experts, _ = _lora_like_setting(permutation=True)
    permuted = merge_models(p_base, p_experts, method).state_dict()
    base_state, p_base_state = base.state_dict(), p_base.state_dict()
    for key, delta in deltas.items():
        moved = merged[key] - base_state[key]
        torch.testing.assert_close(permuted[key] - p_base_state[key], _permuted(moved), rtol=0, atol=2e-6, msg=key)
        u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
        expected = s[:2].mean() * u[:, :2] @ vh[:2]
        torch.testing.assert_close(moved.double(), expected, rtol=0, atol=2e-6, msg=key)


def test_tsv_m_warns_naming_the_matrices_more_experts_than_their_rank_keep_as_the_base():
    """k = ⌊r/T⌋ = 0 where T > r: those matrices keep the base's value, and a warning names them."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()  # k_proj and v_proj are 2 × 16: rank 2 < 3 experts
    generator = torch.Generator().manual_seed(1)
    experts = {f"task{i}": perturbed(base, generator, 0.05) for i in range(3)}
    with pytest.warns(UserWarning, match=r"TSV-M: 2 matrices have a rank min\(m, n\) below the 3 experts and keep "
                                         r"the base model's value .*'model\.layers\.0\.self_attn\.k_proj\.weight', "
                                         r"'model\.layers\.0\.self_attn\.v_proj\.weight'\]"):
        merged = merge_models(base, experts, "tsv_m").state_dict()
    for key in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        assert torch.equal(merged[key], base.state_dict()[key])
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
