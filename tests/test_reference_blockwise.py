"""The library against an independent float64 FeatCal (tests/reference_blockwise.py) on the families
whose blocks hold RMS norms — T5 encoder-decoder and Llama — and on the pooled-head encoders (BERT,
ViT), at the default hyperparameters (λ = 0.05, ρ = 2.2, α = 0.25, ε = 1e-8, last-block token weight
0.01), with three tasks whose experts differ from the base in every parameter, norms included.

At these settings every part of the method moves the result: the norm solves and their ridge, the
teacher interpolation α, the task scales s_i, the anchor ρ, and the pooled token weights."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForSequenceClassification,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from reference_blockwise import causal_lm_spec, pooled_encoder_spec, reference_featcal, t5_spec
from test_llm import llm_config, lm_batch
from test_t5 import seq2seq_batch, t5_config
from testing_utils import perturbed, task_arithmetic

TASKS = ("alpha", "beta", "gamma")


def _randomise_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Norm weights (and LayerNorm biases) away from 1 / 0, so the norm solves have work to do."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def _setting(build, batch, generator, scale=0.05):
    base = build().double().eval()
    _randomise_norms(base, generator)
    # experts differ from the base in every parameter, norms included, each by its own amount
    experts = {t: perturbed(base, generator, scale * (1 + i)).eval() for i, t in enumerate(TASKS)}
    merged = task_arithmetic(base, experts)
    data = {t: [batch(generator), batch(generator)] for t in TASKS}
    return base, experts, merged, data


def _assert_equal_to_reference(merged, base, experts, data, spec, block_prefixes, config=None, **reference_kwargs):
    given = {n: p.detach().clone() for n, p in merged.named_parameters()}
    expected = dict(reference_featcal(merged, base, experts, data, spec, **reference_kwargs).named_parameters())
    calibrator = FeatCalCalibrator(merged, base, experts, data, config or FeatCalConfig(compute_dtype="float64"),
                                   show_progress=False)
    calibrator.calibrate()
    changed = 0
    for name, value in merged.named_parameters():
        ref, value = expected[name].detach(), value.detach()
        assert value.dtype == torch.float64
        if not name.startswith(block_prefixes):
            assert torch.equal(value, given[name]), f"{name} is outside the blocks and must keep its merged value"
            continue
        err = float((value - ref).norm() / ref.norm().clamp_min(1e-30))
        assert err <= 1e-8, f"{name}: relative difference {err:.3e} to the float64 reference"
        changed += not torch.allclose(ref, given[name], rtol=1e-6, atol=0)
    # the reference really calibrated the blocks: (nearly) every block parameter moved
    assert changed >= 0.9 * sum(name.startswith(block_prefixes) for name in given)


def test_t5_encoder_decoder_equals_the_float64_reference(generator):
    """Relative position bias (block 0 of each stack), cross-attention on each stream's own encoder
    output, gated-gelu, padding in encoder (attention_mask) and decoder (-100 labels)."""
    base, experts, merged, data = _setting(
        lambda: T5ForConditionalGeneration(t5_config(num_layers=2, num_decoder_layers=2)), seq2seq_batch, generator
    )
    _assert_equal_to_reference(merged, base, experts, data, t5_spec(merged), ("encoder.block.", "decoder.block."))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_llama_family_equals_the_float64_reference(family, generator):
    """Grouped-query attention (4 query heads, 2 key/value heads), gated MLP, rotary embeddings and
    left padding; Llama with Linear biases, Qwen3 with its per-head q/k RMS norms."""
    options = dict(attention_bias=True, mlp_bias=True) if family == "llama" else {}
    base, experts, merged, data = _setting(
        lambda: AutoModelForCausalLM.from_config(llm_config(family, **options)), lm_batch, generator
    )
    _assert_equal_to_reference(merged, base, experts, data, causal_lm_spec(merged), ("model.layers.",))


def test_llama_without_base_anchors_at_the_merge(generator):
    """No base: the anchor is the merged weights (A = θᵐ), at non-default λ and α."""
    base, experts, merged, data = _setting(lambda: AutoModelForCausalLM.from_config(llm_config("llama")), lm_batch,
                                           generator)
    config = FeatCalConfig(compute_dtype="float64", lambda_ratio=0.3, teacher_alpha=0.6)
    _assert_equal_to_reference(merged, None, experts, data, causal_lm_spec(merged), ("model.layers.",), config,
                               lam=0.3, alpha=0.6)


def _text_batch(generator, n=4, length=7):
    ids = torch.randint(3, 40, (n, length), generator=generator)
    mask = torch.ones(n, length, dtype=torch.long)
    ids[0, 5:], mask[0, 5:] = 1, 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_pooled_encoders_equal_the_float64_reference(family, generator):
    """Post-norm BERT and pre-norm ViT, both pooled on token 0: in the last block every module but
    the key/value projections weighs the other tokens 0.01."""
    if family == "bert":
        build = lambda: BertForSequenceClassification(BertConfig(  # noqa: E731
            vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            num_labels=3))
        batch, prefixes = _text_batch, ("bert.encoder.layer.",)
        blocks, key_value, mask_key = (lambda m: list(m.bert.encoder.layer)), (
            "attention.self.key", "attention.self.value"), "attention_mask"
    else:
        build = lambda: ViTForImageClassification(ViTConfig(  # noqa: E731
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
            patch_size=4, num_labels=3))
        batch = lambda g: {"pixel_values": torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)}  # noqa: E731
        prefixes, mask_key = ("vit.layers.", "vit.encoder.layer."), None
        blocks = lambda m: list(getattr(m.vit, "layers", None) or m.vit.encoder.layer)  # noqa: E731
        key_value = ("attention.k_proj", "attention.v_proj", "attention.attention.key", "attention.attention.value")
    base, experts, merged, data = _setting(build, batch, generator)
    spec = pooled_encoder_spec(merged, blocks, key_value, mask_key=mask_key)
    _assert_equal_to_reference(merged, base, experts, data, spec, prefixes)
