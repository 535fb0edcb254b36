"""What real use of FeatCal on pretrained text encoders needs (issue 31): texts truncated to the model's
maximum, a per-task measure of what the head reads in the drift report, the effective-token warning,
and mean-pooled encoders. Tiny random-init BERTs built from configs; every expected value is computed
here from full-model forwards, independently of the library's pipeline."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalWarning
from testing_utils import perturbed, record_prepared_batches, task_arithmetic

VOCAB = 40


def _bert(hidden: int = 16, intermediate: int = 32, max_positions: int = 32) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=intermediate, max_position_embeddings=max_positions, num_labels=3)
    return BertForSequenceClassification(config).eval()


def _setting(generator, tasks=("a", "b"), **bert):
    base = _bert(**bert)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in tasks}
    return base, experts, task_arithmetic(base, experts)


def _text_batch(generator, n: int = 4, length: int = 12) -> dict:
    """Token ids with the last rows padded (padding must weigh 0 everywhere)."""
    ids = torch.randint(3, VOCAB, (n, length), generator=generator)
    mask = torch.ones(n, length, dtype=torch.long)
    ids[0, length // 2:], mask[0, length // 2:] = 0, 0
    ids[1, length - 2:], mask[1, length - 2:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace tokenizer without a known maximum (its model_max_length is transformers' placeholder)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


# ---------------------------------------------------------------------------------------- 1. truncation
def test_dataset_texts_are_truncated_to_the_models_maximum_or_max_length(generator, monkeypatch):
    prepared = record_prepared_batches(monkeypatch)  # (let go once their streams entered)
    base, experts, merged = _setting(generator, max_positions=16)
    tokenizer = _word_tokenizer()
    assert tokenizer.model_max_length > 10**12  # no maximum known to the tokenizer: the model's is used
    words = [f"w{i}" for i in range(2, VOCAB)]
    texts = [" ".join(words[(3 * k) % 30 : (3 * k) % 30 + n]) for k, n in enumerate([30, 5, 25, 3, 38, 8, 2, 20])]
    data = {t: Dataset.from_dict({"text": texts, "label": list(range(8))}) for t in experts}

    limited = copy.deepcopy(tokenizer)
    limited.model_max_length = 10  # a tokenizer's own maximum, below the model's, wins
    cases = [(FeatCalConfig(batch_size=4), tokenizer, 16), (FeatCalConfig(batch_size=4, max_length=6), tokenizer, 6),
             (FeatCalConfig(batch_size=4), limited, 10)]
    for config, processing_class, limit in cases:
        calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, config,
                                       processing_class=processing_class, show_progress=False)
        got = prepared["a"]
        assert calibrator.batch_sizes["a"] == [4, 4]
        order = Dataset.from_dict({"text": texts}).shuffle(seed=config.seed)["text"]
        rows = [(ids, mask) for b in got for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)]
        assert [b["input_ids"].shape[1] for b in got] == [limit, limit]  # every batch holds a text over the limit
        for text, (ids, mask) in zip(order, rows, strict=True):
            expected = tokenizer(text)["input_ids"][:limit]  # the text's own tokens, cut at the limit
            assert ids[mask.bool()].tolist() == expected
    calibrator.calibrate()  # the truncated batches run through a model of 16 positions


def test_max_length_is_checked():
    with pytest.raises(ValueError, match=r"FeatCalConfig\.max_length must be a positive integer or None, got 0"):
        FeatCalConfig(max_length=0)


# ------------------------------------------------------------------------- 2. what the head reads
def _relative_drift(model, expert, batches, layer: int, pooled: bool, other_weight: float) -> float:
    """Σ w‖h − h_expert‖ / Σ w‖h_expert‖ at `hidden_states[layer]` of full-model forwards."""
    distance = size = 0.0
    for batch in batches:
        with torch.no_grad():
            h = model(**batch, output_hidden_states=True).hidden_states[layer].double()
            e = expert(**batch, output_hidden_states=True).hidden_states[layer].double()
        w = batch["attention_mask"].double()
        if pooled:  # the head reads [CLS]; the other tokens weigh `other_weight`, as the calibration weighs them
            w = w * torch.cat([torch.ones(w.shape[0], 1), torch.full((w.shape[0], w.shape[1] - 1), other_weight)],
                              1).double()
        distance += float(((h - e).norm(dim=-1) * w).sum())
        size += float((e.norm(dim=-1) * w).sum())
    return distance / size


def test_drift_report_measures_what_each_head_reads_and_flags_a_task_it_hurts(generator):
    base, experts, merged = _setting(generator)
    # a task whose expert is the merge itself: nothing to gain, and the joint compromise moves it away
    experts["merge_itself"] = copy.deepcopy(merged)
    data = {t: [_text_batch(generator), _text_batch(generator)] for t in experts}
    given = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    with pytest.warns(FeatCalWarning,
                      match=r"what the head reads moved away from the expert for task\(s\) \['merge_itself'\]"):
        calibrator.calibrate()
    report = calibrator.report
    for task, expert in experts.items():
        stages = report.tasks[task]
        for layer in (1, 2):  # block outputs are hidden_states[1:]; the last block's head weighting is pooled
            pooled = layer == 2
            assert stages["head_before"][layer - 1] == pytest.approx(
                _relative_drift(given, expert, data[task], layer, pooled, 0.01), rel=1e-5, abs=1e-7)
            assert stages["head_after"][layer - 1] == pytest.approx(
                _relative_drift(merged, expert, data[task], layer, pooled, 0.01), rel=1e-5, abs=1e-7)
    assert report.tasks["merge_itself"]["head_before"][-1] == 0.0
    assert report.rising_tasks() == ["merge_itself"]
    assert all(report.tasks[t]["head_after"][-1] < report.tasks[t]["head_before"][-1] for t in ("a", "b"))
    summary = report.summary_markdown()
    assert "merge_itself" in summary and "**rises**" in summary and summary.count("**rises**") == 1
    assert "head reads: relative distance to the expert (lower is better)" in summary.splitlines()[0]
    assert type(report).from_dict(report.to_dict()).rising_tasks() == ["merge_itself"]


IN_SAMPLE, HELD_OUT = "what the head reads moved away", "on the held-out examples"


def _warnings_starting(caught, prefix: str) -> list[str]:
    """The FeatCalWarnings' messages among `caught` that begin with `prefix`."""
    return [str(w.message) for w in caught if issubclass(w.category, FeatCalWarning)
            and str(w.message).startswith(prefix)]


def test_a_task_hurt_on_held_out_examples_is_warned_about_with_the_reports_values(generator):
    """With a held-out share, calibrate() also warns about the tasks whose held-out head measure rose,
    with the report's own values; without one (the test above) no such warning comes."""
    base, experts, merged = _setting(generator)
    experts["merge_itself"] = copy.deepcopy(merged)
    data = {t: [_text_batch(generator) for _ in range(4)] for t in experts}
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(heldout_fraction=0.5),
                                   show_progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrator.calibrate()
    report = calibrator.report
    assert report.heldout_rising_tasks() == ["merge_itself"]  # its held-out drift starts at 0
    stages = report.tasks["merge_itself"]
    assert stages["heldout_head_before"][-1] == 0.0 < stages["heldout_head_after"][-1]
    held_out = _warnings_starting(caught, HELD_OUT)
    assert len(held_out) == 1
    assert held_out[0].startswith("on the held-out examples what the head reads moved away from the expert for "
                                  "task(s) ['merge_itself'] (relative drift at the last block merge_itself: "
                                  f"0.00% → {stages['heldout_head_after'][-1]:.2%})")
    assert "guard='no_rise'" in held_out[0]
    # the in-sample warning keeps coming beside it, for the tasks that rose in sample
    in_sample = _warnings_starting(caught, IN_SAMPLE)
    assert len(in_sample) == (1 if report.rising_tasks() else 0)
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, FeatCalWarning)
               and "head reads" in str(w.message))  # pointed at the caller of calibrate()


def test_no_held_out_warning_without_a_held_out_share(generator):
    base, experts, merged = _setting(generator)
    experts["merge_itself"] = copy.deepcopy(merged)
    data = {t: [_text_batch(generator), _text_batch(generator)] for t in experts}
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrator.calibrate()
    assert calibrator.report.heldout_rising_tasks() == []
    assert _warnings_starting(caught, HELD_OUT) == []
    assert _warnings_starting(caught, IN_SAMPLE)


# ---------------------------------------------------------------------------- 3. effective tokens
def test_effective_token_warning_fires_on_the_pooled_last_block_only(generator):
    """2 tasks × 8 texts of up to 12 tokens: ~150 real tokens per module, ample for inputs of 32 and
    64; but the pooled last block weighs all but [CLS] 0.01, so its non-key/value modules are solved
    from ~2 × (8 + 0.01·~68) ≈ 17 effective tokens against 32 or 64 inputs. Random-init LayerNorms
    (γ=1, β=0) make the Grams after them singular, which the default ridge settles: no warning there."""
    base, experts, merged = _setting(generator, hidden=32, intermediate=64)
    data = {t: [_text_batch(generator), _text_batch(generator)] for t in experts}
    effective = sum(float(b["attention_mask"][:, 0].sum() + 0.01 * b["attention_mask"][:, 1:].sum())
                    for batches in data.values() for b in batches)
    assert effective < 32 < 64 < sum(float(b["attention_mask"].sum()) for bs in data.values() for b in bs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FeatCalCalibrator(merged, base, experts, data, show_progress=False).calibrate()
    messages = [str(w.message) for w in caught if issubclass(w.category, FeatCalWarning)]
    token_warnings = {m.split(": ")[0] for m in messages if "weighted tokens for input dimension" in m}
    assert token_warnings == {
        f"block 1 of encoder, modules ['{name}']"
        for name in ("attention.self.query", "attention.output.dense", "intermediate.dense", "output.dense")
    }, messages
    assert f"{effective:.4g} weighted tokens for input dimension 32" in " ".join(messages)
    assert not [m for m in messages if "block 0" in m or "numerically singular" in m], messages


# ------------------------------------------------------------------------------ 4. mean pooling
def _module_inputs(model, batch, names) -> dict[str, torch.Tensor]:
    """The inputs of the last block's modules `names` in a full-model forward."""
    block = model.bert.encoder.layer[-1]
    captured = {}
    handles = [block.get_submodule(n).register_forward_pre_hook(
        lambda m, args, _n=n: captured.__setitem__(_n, args[0].double())) for n in names]
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    return captured


def test_mean_pooled_encoder_last_block_is_uniformly_weighted_least_squares(generator):
    """`final_block_token_weight=1.0` (every token of the last block weighted as the pooled one) is
    the setting for mean-pooled encoders: each Linear of the last block is then the ridge least
    squares Σ_i s_i E[‖W x_s − W_i x_t‖²] + λ‖W − A‖² with uniform weights over the real tokens."""
    base, experts, merged = _setting(generator)
    data = {t: [_text_batch(generator), _text_batch(generator)] for t in experts}
    given = copy.deepcopy(merged)
    config = FeatCalConfig(final_block_token_weight=1.0, layers_to_transform=[-1])
    FeatCalCalibrator(merged, None, experts, data, config, show_progress=False).calibrate()
    names = ["attention.self.query", "attention.self.key", "attention.output.dense", "intermediate.dense",
             "output.dense"]
    lam, alpha = config.lambda_ratio, config.teacher_alpha
    for name in names:
        lhs, rhs = 0.0, 0.0
        for task, expert in experts.items():
            rows_s, rows_e = [], []
            for batch in data[task]:
                real = batch["attention_mask"].bool()  # uniform weights: every real token once
                rows_s.append(_module_inputs(given, batch, [name])[name][real])
                rows_e.append(_module_inputs(expert, batch, [name])[name][real])
            xs, xe = torch.cat(rows_s), torch.cat(rows_e)
            xt = alpha * xe + (1 - alpha) * xs
            c = xs.T @ xs / len(xs)
            s = 1 / float(torch.linalg.matrix_norm(c))
            w_i = expert.bert.encoder.layer[-1].get_submodule(name).weight.detach().double()
            lhs = lhs + s * c
            rhs = rhs + s * (xs.T @ xt / len(xs)) @ w_i.T
        anchor = given.bert.encoder.layer[-1].get_submodule(name).weight.detach().double()  # no base: A = merged
        system = lhs + (lam + config.epsilon) * torch.eye(lhs.shape[0], dtype=torch.float64)
        expected = torch.linalg.solve(system, rhs + lam * anchor.T).T
        got = merged.bert.encoder.layer[-1].get_submodule(name).weight.detach().double()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
    # the default (the head reads [CLS]) solves a different problem there
    default = copy.deepcopy(given)
    FeatCalCalibrator(default, None, experts, data, FeatCalConfig(layers_to_transform=[-1]),
                      show_progress=False).calibrate()
    query = "attention.self.query"
    gap = (
        default.bert.encoder.layer[-1].get_submodule(query).weight
        - merged.bert.encoder.layer[-1].get_submodule(query).weight
    )
    assert float(gap.detach().norm()) > 1e-3
