"""RegMean++ (and RegMean's Gram rule) against a reference written here from the papers' formulas:
full-model forwards with hooks, in float64, nothing from the library's streams or solver.

The reference builds the merge block by block: the experts' average is the start; for block b and
task i it runs task i's data through a copy of the merge so far whose block b is expert i's, takes
the Grams of block b's Linear inputs there (Σ w·x xᵀ, or divided by the number of tokens with
nonzero weight), and solves Wᵀ = (Σᵢ G̃ᵢ)⁻¹ Σᵢ G̃ᵢ Wᵢᵀ with torch.linalg.solve. With the expert's own
model instead of that copy it is RegMean."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

from hf_featcal.merging import merge_models
from hf_featcal.merging.methods.regmean_plusplus import regmean_plusplus_merging
from hf_featcal.regmean import regmean_merging
from test_llm import llm_config, lm_batch
from testing_utils import as_float64, build_clip_setting, perturbed, randomise_norms

# Both sides compute in float64, but the merge engine averages every tensor in float32 (for any model
# dtype): those averages, the embeddings and norms the merged stream runs through, carry float32 rounding
# (measured 4e-8), which reaches RegMean++'s Linears (measured 3e-7). RegMean's own-stream Linears agree to
# 1e-14. What the tests tell apart (rule, stream, padding count) moves weights by 1e-1.
MERGED_STREAM_TOLERANCE = 1e-6
OWN_STREAM_TOLERANCE = 1e-12
AVERAGE_TOLERANCE = 1e-7


def _block_grams(model, block, batches, weights_of, gram_rule):
    """Per Linear of `block` (a submodule of `model`): the Gram of its inputs over full forwards of `model`."""
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    sums, counts = {}, {}
    for batch in batches:
        seen = {}
        handles = [m.register_forward_pre_hook(lambda mod, args, _n=n, seen=seen: seen.__setitem__(_n, args[0]))
                   for n, m in linears.items()]
        with torch.no_grad():
            model(**batch)
        for h in handles:
            h.remove()
        for name, x in seen.items():
            w = weights_of(batch, x).reshape(-1).double()
            x = x.reshape(-1, x.shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * w[:, None]).T @ x
            counts[name] = counts.get(name, 0) + int((w != 0).sum())
    if gram_rule == "token_mean":
        return {n: sums[n] / counts[n] for n in sums}
    return sums


def _reference(experts, data, blocks, weights_of, *, reduction, gram_rule, merged_stream=True):
    """RegMean++ (merged_stream) or RegMean, per the module docstring."""
    states = [e.state_dict() for e in experts.values()]
    merged = copy.deepcopy(next(iter(experts.values())))
    merged.load_state_dict({k: sum(s[k] for s in states) / len(states) if v.is_floating_point() else v
                            for k, v in states[0].items()})
    for b in range(len(blocks(merged))):
        grams = {}
        for task, expert in experts.items():
            probe = expert
            if merged_stream:
                probe = copy.deepcopy(merged)
                blocks(probe)[b].load_state_dict(blocks(expert)[b].state_dict())
            grams[task] = _block_grams(probe, blocks(probe)[b], data[task], weights_of, gram_rule)
        for name, module in blocks(merged)[b].named_modules():
            if isinstance(module, nn.Linear):
                lhs, rhs = 0, 0
                for task, expert in experts.items():
                    g = grams[task][name]
                    g = reduction * g + (1 - reduction) * torch.diag(torch.diagonal(g))
                    lhs = lhs + g
                    rhs = rhs + g @ blocks(expert)[b].get_submodule(name).weight.double().T
                with torch.no_grad():
                    module.weight.copy_(torch.linalg.solve(lhs, rhs).T)
    return merged


def _assert_equal(got, expected, linears=MERGED_STREAM_TOLERANCE, others=AVERAGE_TOLERANCE):
    """Every floating tensor of `got` within a norm-wise relative tolerance of `expected`'s: `linears`
    for the Linears' weights, `others` for the rest."""
    linear_weights = {f"{n}.weight" for n, m in got.named_modules() if isinstance(m, nn.Linear)}
    expected_state = expected.state_dict()
    for key, value in got.state_dict().items():
        if value.is_floating_point():
            ref = expected_state[key]
            tolerance = linears if key in linear_weights else others
            assert float((value - ref).norm()) <= tolerance * float(ref.norm()), key


def _relative_distance(a, b):
    """The largest norm-wise relative distance between two models' floating tensors."""
    sb = b.state_dict()
    return max(float((v - sb[k]).norm() / sb[k].norm()) for k, v in a.state_dict().items() if v.is_floating_point())


def _clip_blocks(model):
    return list(getattr(model, "vision_model", model).encoder.layers)


def _every_token(batch, x):
    return torch.ones(x.shape[:-1])  # images: no padding


@pytest.fixture
def clip_unequal(generator):
    """The tiny CLIP setting in float64 where the tasks bring different numbers of images (13 and 5)."""
    base, experts, _, data = as_float64(*build_clip_setting(generator))
    return base, experts, {"cars": data["cars"], "dtd": data["dtd"][:1]}


def test_clip_equals_reference_for_both_gram_rules(clip_unequal):
    base, experts, data = clip_unequal
    results = {}
    for rule in ("token_mean", "sum"):
        results[rule] = regmean_plusplus_merging(base, experts, data, gram_rule=rule)
        _assert_equal(results[rule], _reference(experts, data, _clip_blocks, _every_token, reduction=0.95,
                                                gram_rule=rule))
        assert results[rule].config.hf_featcal_merge == {
            "method": "regmean_plusplus", "reduction": 0.95, "gram_rule": rule, "experts": ["cars", "dtd"]}
    # unequal token counts: the rule matters (a task weighs by its count under "sum", not under "token_mean")
    assert _relative_distance(results["sum"], results["token_mean"]) > 1e-2
    # the merged stream matters: RegMean (each expert's own stream) is another merge
    regmean = regmean_merging(base, experts, data, reduction=0.95, gram_rule="token_mean")
    assert _relative_distance(regmean, results["token_mean"]) > 1e-2


def test_equal_token_counts_make_the_gram_rules_agree(generator):
    base, experts, _, data = as_float64(*build_clip_setting(generator))  # 13 images per task
    by_sum = regmean_plusplus_merging(base, experts, data, gram_rule="sum", reduction=0.5)
    _assert_equal(by_sum, _reference(experts, data, _clip_blocks, _every_token, reduction=0.5, gram_rule="sum"))
    # one scale per task, the same for all: it cancels in the solve (to float64 rounding)
    by_mean = regmean_plusplus_merging(base, experts, data, gram_rule="token_mean", reduction=0.5)
    _assert_equal(by_mean, by_sum, linears=OWN_STREAM_TOLERANCE, others=0.0)


def test_regmean_token_mean_equals_reference(clip_unequal):
    base, experts, data = clip_unequal
    merged = regmean_merging(base, experts, data, gram_rule="token_mean")
    _assert_equal(merged, _reference(experts, data, _clip_blocks, _every_token, reduction=0.9,
                                     gram_rule="token_mean", merged_stream=False), linears=OWN_STREAM_TOLERANCE)
    by_sum = regmean_merging(base, experts, data)  # the default: the paper's sum (tests/test_regmean.py)
    assert _relative_distance(merged, by_sum) > 1e-2
    assert merged.config.hf_featcal_merge["gram_rule"] == "token_mean"


def test_llama_counts_only_weighted_tokens(generator):
    """Tasks with different padding: padded positions neither enter the Gram nor its token count."""
    base = AutoModelForCausalLM.from_config(llm_config("llama")).double().eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    heavy = lm_batch(generator)
    heavy["attention_mask"][:3, :4] = 0  # left padding on three rows of math's second batch
    data = {"math": [lm_batch(generator), heavy], "code": [lm_batch(generator, pad=False), lm_batch(generator)]}
    blocks = lambda m: list(m.model.layers)  # noqa: E731
    mask = lambda batch, x: batch["attention_mask"]  # noqa: E731
    merged = regmean_plusplus_merging(base, experts, data)
    _assert_equal(merged, _reference(experts, data, blocks, mask, reduction=0.95, gram_rule="token_mean"))
    # counting the padded positions too (FusionBench's count) is another merge here
    every = lambda batch, x: torch.ones(x.shape[:-1])  # noqa: E731
    counted_padding = _reference(experts, data, blocks, every, reduction=0.95, gram_rule="token_mean")
    assert _relative_distance(merged, counted_padding) > 1e-2


def test_t5_stream_crosses_into_the_decoder(generator):
    """Two stacks: the decoder's Grams use the merged encoder's output (cross-attention keys/values
    weighted by the encoder's mask, the rest by the target tokens)."""
    base = T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2,
                                               vocab_size=50, decoder_start_token_id=0)).double().eval()
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}

    def batch(rows):
        mask = torch.ones(rows, 6, dtype=torch.long)
        mask[0, 4:] = 0
        labels = torch.randint(1, 50, (rows, 3), generator=generator)
        labels[1, 2] = -100
        return {"input_ids": torch.randint(1, 50, (rows, 6), generator=generator), "attention_mask": mask,
                "labels": labels}

    data = {"a": [batch(4), batch(3)], "b": [batch(4)]}
    blocks = lambda m: list(m.encoder.block) + list(m.decoder.block)  # noqa: E731

    def weights_of(b, x):
        if x.shape[1] == b["input_ids"].shape[1]:  # the encoder's positions (cross-attention k/v read them too)
            return b["attention_mask"]
        return (b["labels"] != -100).long()

    merged = regmean_plusplus_merging(base, experts, data)
    _assert_equal(merged, _reference(experts, data, blocks, weights_of, reduction=0.95, gram_rule="token_mean"))


def test_bad_parameters_are_refused_before_any_forward(generator):
    base, experts, _, data = build_clip_setting(generator)
    calls = []
    for model in (base, *experts.values()):
        model.register_forward_pre_hook(lambda *args: calls.append(1))
    for kwargs, message in [
        ({"reduction": 1.5}, r"`reduction` must be in \[0, 1\], got 1.5"),
        ({"reduction": float("nan")}, r"`reduction` must be a finite real number"),
        ({"gram_rule": "mean"}, r"`gram_rule` must be one of 'sum', 'token_mean', got 'mean'"),
        ({"gram_rule": None}, r"`gram_rule` must be one of 'sum', 'token_mean', got None"),
    ]:
        with pytest.raises(ValueError, match=message):
            regmean_plusplus_merging(base, experts, data, **kwargs)
        with pytest.raises(ValueError, match=message):
            merge_models(base, experts, "regmean", calibration_data=data, **kwargs)
    assert calls == []
    with pytest.raises(TypeError, match=r"experts\['cars'\] must be an in-memory model for RegMean\+\+"):
        regmean_plusplus_merging(base, {**experts, "cars": "some/folder"}, data)
    with pytest.raises(ValueError,
                       match=r"regmean_plusplus_merging: FeatCalConfig.batch_size must be a positive integer, got 0"):
        regmean_plusplus_merging(base, experts, data, batch_size=0)
    poisoned = [dict(b) for b in data["dtd"]]
    poisoned[1] = {"pixel_values": poisoned[1]["pixel_values"].clone()}
    poisoned[1]["pixel_values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError,
                       match=r"non-finite values in the features of calibration_data\['dtd'\] entering block 0"):
        regmean_plusplus_merging(base, experts, {**data, "dtd": poisoned})


def test_callers_models_unchanged_and_registry_dispatch(generator):
    base, experts, _, data = build_clip_setting(generator)
    experts["dtd"].train()  # a training flag is the caller's: restored
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in [("base", base), *experts.items()]}
    merged = merge_models(base, experts, "regmean_plusplus", calibration_data=data, num_samples_per_task=None)
    direct = regmean_plusplus_merging(base, experts, data, num_samples_per_task=None)
    for a, b in zip(merged.parameters(), direct.parameters(), strict=True):
        assert torch.equal(a, b)
    for name, model in [("base", base), *experts.items()]:
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[name][key]), (name, key)
    assert experts["dtd"].training and not experts["cars"].training
    assert all(torch.isfinite(p).all() for p in merged.parameters())
