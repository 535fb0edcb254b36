"""RegMean against brute force: per Linear, least squares over every expert's own captured inputs
(tests/reference-style hooks on full-model forwards, nothing from the library's streams)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_featcal.regmean import regmean_merging
from test_llm import llm_config, lm_batch
from testing_utils import as_float64, build_clip_setting, perturbed


def _linear_inputs(model, blocks, batches, weights_of):
    """Per Linear (block index, name): every weighted input row of the model's own forwards, and the weights."""
    rows: dict = {}
    for batch in batches:
        seen = {}
        handles = [
            m.register_forward_pre_hook(lambda mod, args, _k=(i, n), seen=seen: seen.__setitem__(_k, args[0]))
            for i, block in enumerate(blocks(model))
            for n, m in block.named_modules()
            if isinstance(m, nn.Linear)
        ]
        with torch.no_grad():
            model(**batch)
        for h in handles:
            h.remove()
        for key, x in seen.items():
            w = weights_of(batch, x).reshape(-1)
            keep = w > 0
            rows.setdefault(key, []).append((x.reshape(-1, x.shape[-1])[keep].double(), w[keep].double()))
    return {k: (torch.cat([r for r, _ in v]), torch.cat([w for _, w in v])) for k, v in rows.items()}


def _brute_force(experts, data, blocks, weights_of, reduction):
    inputs = {t: _linear_inputs(e, blocks, data[t], weights_of) for t, e in experts.items()}
    expected = {}
    for key in next(iter(inputs.values())):
        i, name = key
        if reduction == 1.0:  # plain least squares over the stacked, weight-scaled rows of every expert
            xs = torch.cat([inputs[t][key][0] * inputs[t][key][1].sqrt()[:, None] for t in experts])
            ys = torch.cat([inputs[t][key][0] * inputs[t][key][1].sqrt()[:, None]
                            @ blocks(e)[i].get_submodule(name).weight.double().T for t, e in experts.items()])
            expected[key] = torch.linalg.lstsq(xs, ys).solution.T
        else:  # the RegMean formula written out
            lhs, rhs = 0, 0
            for t, e in experts.items():
                x, w = inputs[t][key]
                g = (x * w[:, None]).T @ x
                g = reduction * g + (1 - reduction) * torch.diag(torch.diagonal(g))
                lhs = lhs + g
                rhs = rhs + g @ blocks(e)[i].get_submodule(name).weight.double().T
            expected[key] = torch.linalg.solve(lhs, rhs).T
    return expected


def _clip_blocks(model):
    return list(getattr(model, "vision_model", model).encoder.layers)


@pytest.mark.parametrize("reduction", [1.0, 0.9])
def test_clip_vision_equals_brute_force(generator, reduction):
    base, experts, _, data = as_float64(*build_clip_setting(generator))
    merged = regmean_merging(base, experts, data, reduction=reduction)
    ones = lambda batch, x: torch.ones(x.shape[:-1])  # noqa: E731  - images: every token counts
    expected = _brute_force(experts, data, _clip_blocks, ones, reduction)
    for (i, name), weight in expected.items():
        got = _clip_blocks(merged)[i].get_submodule(name).weight.detach()
        assert float((got - weight).norm() / weight.norm()) <= 1e-8, (i, name)
    # everything else is the plain average of the experts (merging computes in float32)
    states = [e.state_dict() for e in experts.values()]
    linear_weights = {f"encoder.layers.{i}.{n}.weight" for i, n in expected}
    for key, value in merged.state_dict().items():
        if key not in linear_weights and value.is_floating_point():
            torch.testing.assert_close(value, sum(s[key] for s in states) / len(states), rtol=1e-6, atol=1e-7, msg=key)
    assert merged.config.hf_featcal_merge == {"method": "regmean", "reduction": reduction, "gram_rule": "sum",
                                              "experts": list(experts)}


def test_llama_padding_weighs_nothing(generator):
    base = AutoModelForCausalLM.from_config(llm_config("llama")).double().eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    data = {t: [lm_batch(generator), lm_batch(generator)] for t in experts}
    merged = regmean_merging(base, experts, data)
    blocks = lambda m: list(m.model.layers)  # noqa: E731
    expected = _brute_force(experts, data, blocks, lambda batch, x: batch["attention_mask"], 0.9)
    for (i, name), weight in expected.items():
        got = blocks(merged)[i].get_submodule(name).weight.detach()
        assert float((got - weight).norm() / weight.norm()) <= 1e-8, (i, name)
    # padded positions carry no weight: other content under the zero mask changes nothing
    junk = {t: [{**b, "input_ids": torch.where(b["attention_mask"].bool(), b["input_ids"], 7)} for b in bs]
            for t, bs in data.items()}
    again = regmean_merging(base, experts, junk)
    for (p, q) in zip(merged.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_bad_arguments_are_named(generator):
    base, experts, _, data = build_clip_setting(generator)
    with pytest.raises(ValueError, match="`reduction` must be in \\[0, 1\\], got 1.5"):
        regmean_merging(base, experts, data, reduction=1.5)
    with pytest.raises(TypeError, match=r"experts\['cars'\] must be an in-memory model"):
        regmean_merging(base, {**experts, "cars": "some/folder"}, data)
    with pytest.raises(ValueError,
                       match=r"tasks \['dtd'\] have an expert in `experts` but no entry in `calibration_data`"):
        regmean_merging(base, experts, {"cars": data["cars"]})


def test_bad_inputs_get_the_calibrators_checks(generator):
    """Issue 29 item 11: an empty task, a fewer-layer expert, NaN features and zero samples used to give a
    bare KeyError, a torch INTERNAL ASSERT or reshape errors; now the calibrator's checks name them."""
    from transformers import CLIPVisionModel

    from testing_utils import tiny_vision_config

    base, experts, _, data = build_clip_setting(generator)
    with pytest.raises(ValueError, match=r"calibration_data\['dtd'\] is empty"):
        regmean_merging(base, experts, {**data, "dtd": []})
    shallow = CLIPVisionModel(tiny_vision_config(num_hidden_layers=1))
    with pytest.raises(ValueError,
                       match=r"`experts\['dtd'\]` has a different configuration .*num_hidden_layers: merged 2 vs 1"):
        regmean_merging(base, {**experts, "dtd": shallow}, data)
    poisoned = [dict(batch) for batch in data["dtd"]]
    poisoned[1] = {"pixel_values": poisoned[1]["pixel_values"].clone()}
    poisoned[1]["pixel_values"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError,
                       match=r"non-finite values in the features of calibration_data\['dtd'\] entering block 0"):
        regmean_merging(base, experts, {**data, "dtd": poisoned})
    with pytest.raises(ValueError, match=r"num_samples_per_task must be a positive integer or None, got 0"):
        regmean_merging(base, experts, data, num_samples_per_task=0)
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        regmean_merging(base, experts, data, batch_size=0)
    with pytest.raises(ValueError, match=r"calibration_data\['cars'\]: the merged model cannot take its batches"):
        regmean_merging(base, experts, {**data, "cars": [{"pixel_values": torch.randn(2, 3, 5, 5)}]})
