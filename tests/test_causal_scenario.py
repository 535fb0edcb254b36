"""The toy causal-LM merging scenario (tiny Llama, prompt-then-answer tasks, exact match) and
FeatCal's efficacy on it."""

from __future__ import annotations

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.merging import task_arithmetic
from scenarios.causal import (
    CAUSAL_VOCABULARY,
    SEPARATOR,
    CausalScenarioConfig,
    build_causal_calibration_batches,
    build_causal_scenario,
    build_causal_tokenizer,
    collate_causal,
    encode_causal,
    evaluate_causal_exact_match,
)
from scenarios.text import TASKS, VOCABULARY, generate_task_examples, make_task_example

torch.set_num_threads(1)

# Small enough to build three times in a few seconds (determinism and caching checks).
MINI = CausalScenarioConfig(num_train=80, num_test=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, pretrain_steps=4, expert_steps=3,
                            batch_size=8, calibration_samples=16, calibration_batch_size=8)


@pytest.fixture(scope="module")
def scenario():
    """The full default scenario, seed 0 (built once for the module; ~30–40 s on one CPU thread)."""
    return build_causal_scenario(seed=0)


@pytest.fixture(scope="module")
def ta_merge(scenario):
    return task_arithmetic(scenario.base, scenario.experts, scaling_factor=0.3).eval()


@pytest.fixture(scope="module")
def scores(scenario, ta_merge):
    return {
        "base": scenario.evaluate(scenario.base),
        "experts": {task: scenario.evaluate(expert)[task] for task, expert in scenario.experts.items()},
        "ta": scenario.evaluate(ta_merge),
    }


# ----------------------------------------------------------------------------------------- tokenizer / data
def test_tokenizer_extends_the_toy_vocabulary():
    tokenizer = build_causal_tokenizer()
    assert CAUSAL_VOCABULARY[: len(VOCABULARY)] == VOCABULARY and CAUSAL_VOCABULARY[-1] == SEPARATOR
    assert len(tokenizer) == len(CAUSAL_VOCABULARY)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids(SEPARATOR) == len(CAUSAL_VOCABULARY) - 1
    text = "sort: 3 1 4 = 1 3 4 </s>"
    ids = tokenizer(text)["input_ids"]  # nothing appended
    assert tokenizer.convert_ids_to_tokens(ids) == text.split()
    assert tokenizer.decode(ids[:-1]) == "sort: 3 1 4 = 1 3 4"


def test_encoding_and_counted_positions():
    tokenizer = build_causal_tokenizer()
    sep, eos = tokenizer.convert_tokens_to_ids(SEPARATOR), tokenizer.eos_token_id
    examples = [make_task_example("min", [3, 1, 4]), make_task_example("sort", [3, 1, 4, 1])]
    pairs = encode_causal(tokenizer, examples)
    assert tokenizer.decode(pairs[0][0]) == "min: 3 1 4 =" and pairs[0][0][-1] == sep
    assert pairs[0][1] == [tokenizer.convert_tokens_to_ids("1"), eos]
    assert tokenizer.decode(pairs[1][1][:-1]) == "1 1 3 4" and pairs[1][1][-1] == eos

    answer = collate_causal(pairs, tokenizer.pad_token_id, "answer")
    predicting = collate_causal(pairs, tokenizer.pad_token_id, "predicting")
    assert torch.equal(answer["input_ids"], predicting["input_ids"])
    assert answer["input_ids"].shape == (2, 11) and answer["attention_mask"].sum(1).tolist() == [7, 11]
    assert answer["input_ids"][0, 7:].tolist() == [0] * 4  # right padding
    # answer: the answer tokens themselves, as standard causal-LM labels
    assert answer["labels"][0].tolist() == [-100] * 5 + pairs[0][1] + [-100] * 4
    kept = answer["labels"] != -100
    assert torch.equal(answer["labels"][kept], answer["input_ids"][kept])
    # predicting: one position earlier (the separator through the last answer token), labelled with
    # the token that position predicts
    assert predicting["labels"][0].tolist() == [-100] * 4 + pairs[0][1] + [-100] * 5
    assert torch.equal(predicting["labels"][:, :-1], answer["labels"][:, 1:])
    assert (predicting["input_ids"][predicting["labels"] != -100][[0, 2]] == sep).all()
    with pytest.raises(ValueError):
        collate_causal(pairs, 0, "prompt")
    with pytest.raises(ValueError):
        CausalScenarioConfig(calibration_positions="prompt")


def test_calibration_batches_from_train_split():
    tokenizer = build_causal_tokenizer()
    train, _ = generate_task_examples("sort", 200, 50)
    batches = build_causal_calibration_batches(tokenizer, train, num_samples=64, batch_size=16, seed=0)
    assert [b["input_ids"].shape[0] for b in batches] == [16, 16, 16, 16]
    train_ids = {tuple(p + a) for p, a in encode_causal(tokenizer, train)}
    for batch in batches:
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        for row, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"], strict=True):
            assert tuple(row[mask.bool()].tolist()) in train_ids
            counted = torch.nonzero(labels != -100).flatten()
            assert bool(mask[counted].all())  # never a padding position
            assert row[counted[0]] == tokenizer.convert_tokens_to_ids(SEPARATOR)
            assert labels[counted[-1]] == tokenizer.eos_token_id
    again = build_causal_calibration_batches(tokenizer, train, num_samples=64, batch_size=16, seed=0)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batches, again, strict=True) for k in a)
    with pytest.raises(ValueError):
        build_causal_calibration_batches(tokenizer, train[:10], num_samples=64)


class _Oracle(torch.nn.Module):
    """Generates the right answer (then junk after the eos) for prompts it knows."""

    def __init__(self, tokenizer, examples, junk):
        super().__init__()
        self.answers = {tuple(p): a for p, a in encode_causal(tokenizer, examples)}
        self.junk = junk

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = [row + (self.answers[tuple(row)] + self.junk)[:max_new_tokens] for row in input_ids.tolist()]
        width = max(map(len, rows))
        return torch.tensor([row + [0] * (width - len(row)) for row in rows])


def test_exact_match_reads_up_to_the_first_eos():
    tokenizer = build_causal_tokenizer()
    test = {task: generate_task_examples(task, 0, 30, seed=5)[1] for task in ("sort", "count")}
    digit = tokenizer.convert_tokens_to_ids("7")
    oracle = _Oracle(tokenizer, [e for examples in test.values() for e in examples], junk=[digit, digit])
    assert evaluate_causal_exact_match(oracle, tokenizer, test, batch_size=7) == {"sort": 100.0, "count": 100.0,
                                                                                  "mean": 100.0}
    # without the eos the junk is part of the answer
    oracle.answers = {k: v[:-1] for k, v in oracle.answers.items()}
    assert evaluate_causal_exact_match(oracle, tokenizer, test)["mean"] == 0.0


def test_mini_scenario_is_deterministic_and_caches(tmp_path):
    first = build_causal_scenario(seed=1, config=MINI)
    second = build_causal_scenario(seed=1, cache_dir=tmp_path, config=MINI)
    other = build_causal_scenario(seed=2, config=MINI)
    assert first.tasks == TASKS and first.test_data == second.test_data and first.train_data == second.train_data
    assert first.test_data != other.test_data
    assert first.base.config.model_type == "llama" and not first.base.config.tie_word_embeddings
    assert first.base.lm_head.weight.data_ptr() != first.base.model.embed_tokens.weight.data_ptr()

    def same(a, b):
        sa, sb = a.state_dict(), b.state_dict()
        return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    assert same(first.base, second.base) and not same(first.base, other.base)
    assert all(same(first.experts[t], second.experts[t]) for t in TASKS)
    assert not same(first.base, first.experts["sort"])
    for task in TASKS:
        assert all(
            torch.equal(a[k], b[k])
            for a, b in zip(first.calibration_batches[task], second.calibration_batches[task], strict=True)
            for k in a
        )
    # reloaded from the cache: same weights, same generations
    cached = build_causal_scenario(seed=1, cache_dir=tmp_path, config=MINI)
    assert (tmp_path / "causal-scenario" / "scenario.json").is_file()
    assert same(first.base, cached.base) and all(same(first.experts[t], cached.experts[t]) for t in TASKS)
    assert first.evaluate(first.experts["min"]) == cached.evaluate(cached.experts["min"])
    # the counted positions are a calibration-data setting, not a build setting: the cache is reused
    answer = build_causal_scenario(seed=1, cache_dir=tmp_path, config=CausalScenarioConfig(
        **{**MINI.to_dict(), "calibration_positions": "answer"}))
    assert same(first.base, answer.base)
    assert torch.equal(answer.calibration_batches["sort"][0]["labels"][:, 1:],
                       first.calibration_batches["sort"][0]["labels"][:, :-1])


# ----------------------------------------------------------------------------------------- full scenario
def test_scenario_shape(scenario):
    cfg = scenario.config
    assert scenario.tasks == TASKS and cfg.num_hidden_layers == 3 and cfg.hidden_size == 64
    assert scenario.base.config.num_key_value_heads == 2 and not scenario.base.config.tie_word_embeddings
    assert scenario.base.config.vocab_size == len(scenario.tokenizer)
    for task in TASKS:
        batches = scenario.calibration_batches[task]
        assert len(batches) == 4 and all(b["input_ids"].shape[0] == 16 for b in batches)
        train_sources = {e.source for e in scenario.train_data[task]}
        assert not train_sources & {e.source for e in scenario.test_data[task]}
    print(f"\ncausal scenario built in {scenario.build_seconds:.1f} s")


# Thresholds on this trained scenario sit well outside the spread measured over seeds 0–4 on one CPU
# (`python benchmarks/scenario_spread.py --scenarios causal`): another CPU rounds differently, and
# training turns that into a different model, much as another seed would. Measured: lowest expert
# task 89.0 (sort), expert mean ≥ 97.2, experts − TA ≥ 28.2 on the mean and ≥ 54 on sort and count,
# FeatCal − TA +3.8 … +9.1, last-block drift after/before ≤ 0.94 per task and ≤ 0.77 over all tasks.
def test_experts_beat_the_merge(scores):
    ta, experts, base = scores["ta"], scores["experts"], scores["base"]
    print(f"\nbase {base}\nexperts {experts}\nTA 0.3 {ta}")
    assert all(experts[t] >= 75.0 for t in TASKS), experts
    expert_mean = sum(experts.values()) / len(experts)
    assert expert_mean >= 90.0, experts
    assert expert_mean - ta["mean"] >= 15.0, (experts, ta)  # the merge loses clearly
    assert sum(experts[t] - ta[t] >= 25.0 for t in TASKS) >= 2, (experts, ta)
    assert all(experts[t] >= ta[t] for t in TASKS)


def test_featcal_beats_task_arithmetic(scenario, ta_merge, scores):
    calibrator = FeatCalCalibrator(ta_merge, scenario.base, scenario.experts, scenario.calibration_batches,
                                   FeatCalConfig(), show_progress=False)
    calibrated = calibrator.calibrate()
    after = scenario.evaluate(calibrated)
    print(f"\nTA 0.3 {scores['ta']}\nTA 0.3 + FeatCal {after}\n{calibrator.report.summary_markdown()}")
    # the claim is the comparison: FeatCal beats the merge it starts from (by +3.8 or more over seeds)
    assert after["mean"] > scores["ta"]["mean"], (scores["ta"], after)
    # drift falls: over all tasks by ≥ 10 % (measured 23–31 %); per task the fall ranges from 6 % to
    # 42 % over seeds (tasks TA already solves move least), so a task only must not get worse by 10 %
    tasks = calibrator.report.tasks
    for task, drift in tasks.items():
        assert len(drift["before"]) == scenario.config.num_hidden_layers
        assert drift["after"][-1] < 1.1 * drift["before"][-1], (task, drift)
    after, before = (sum(d[k][-1] for d in tasks.values()) for k in ("after", "before"))
    assert after <= 0.9 * before, tasks
