"""Tests for the GLUE text-to-text evaluation (hf_featcal.evaluation.glue), fully offline."""

from __future__ import annotations

import json
import math
import warnings

# core dependencies (install_requires / the test extra): a broken install fails here, it is never skipped
import datasets
import evaluate
import numpy as np
import pytest
import torch
import transformers
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from hf_featcal.evaluation import (
    GLUE_TASKS,
    GlueResults,
    compute_glue_scores,
    evaluate_glue,
    format_glue_example,
    glue_metric_path,
    load_glue_metric,
    load_glue_split,
    parse_answer,
    preprocess_glue_dataset,
)
from hf_featcal.evaluation import glue as G

# --------------------------------------------------------------------- fixtures

ROWS: dict[str, dict[str, list]] = {
    "cola": {"sentence": ["the cat sat", "cat the sat", "a dog runs", "dog a runs"], "label": [1, 0, 1, 1]},
    "mnli": {
        "premise": ["a dog runs", "the cat sat", "a man eats", "the sun is hot"],
        "hypothesis": ["an animal moves", "the cat stood", "a man is hungry", "the sun is cold"],
        "label": [0, 2, 1, 2],
    },
    "mrpc": {
        "sentence1": ["the cat sat", "a dog runs", "the sun is hot", "a man eats"],
        "sentence2": ["a cat sat", "the sun is cold", "the sun is warm", "a dog runs"],
        "label": [1, 0, 1, 0],
    },
    "qnli": {
        "question": ["who sat", "what runs", "is it hot", "who eats"],
        "sentence": ["the cat sat", "the sun is hot", "the sun is hot", "a dog runs"],
        "label": [0, 1, 0, 1],
    },
    "qqp": {
        "question1": ["who sat", "what runs", "is it hot", "who eats"],
        "question2": ["who sat down", "is it cold", "is the sun hot", "what runs"],
        "label": [1, 0, 1, 0],
    },
    "rte": {
        "sentence1": ["the cat sat", "a dog runs", "the sun is hot", "a man eats"],
        "sentence2": ["a cat sat", "the dog sleeps", "the sun is warm", "a man is hungry"],
        "label": [0, 1, 0, 1],
    },
    "sst2": {"sentence": ["a great film", "a bad film", "good fun", "so dull"], "label": [1, 0, 1, 1]},
    "stsb": {
        "sentence1": ["the cat sat", "a dog runs", "the sun is hot", "a man eats"],
        "sentence2": ["a cat sat", "the sun is cold", "the sun is warm", "a dog runs"],
        "label": [4.8, 0.2, 3.25, 1.0],
    },
}


def glue_dataset(task: str) -> datasets.Dataset:
    return datasets.Dataset.from_dict(ROWS[task])


STSB_VALUES = [f"{i / 10:.1f}" for i in range(51)]


@pytest.fixture(scope="module")
def tokenizer():
    """Offline WordLevel tokenizer over the template words, label words and test sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    texts = list(G.GLUE_PROMPT_TEMPLATES.values())
    texts += [w for words in G.GLUE_LABEL_WORDS.values() for w in words]
    texts += [s for rows in ROWS.values() for k, col in rows.items() if k != "label" for s in col]
    words = sorted({piece for t in texts for piece, _ in pre.pre_tokenize_str(t)})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.add_tokens(STSB_VALUES)  # "3.2" etc. as single tokens, so they decode verbatim
    return fast


def tiny_t5(vocab_size: int, seed: int = 0) -> transformers.T5ForConditionalGeneration:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab_size, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )
    return T5ForConditionalGeneration(config).eval()


def forced_t5(vocab_size: int, answer_id: int) -> transformers.T5ForConditionalGeneration:
    """A tiny T5 that always generates ``answer_id`` then ``</s>`` (id 1).

    The decoder blocks add nothing to the residual stream, so the final hidden state is the
    normalised embedding of the current decoder input; with tied embeddings W the logits
    are proportional to W[input] . W[j]. With W[start]=e0, W[answer]=2e0+e1, W[eos]=10e1
    (other rows 0): start -> answer (2 > 1), answer -> eos (10 > 5).
    """
    model = tiny_t5(vocab_size)
    assert answer_id not in (0, 1)
    with torch.no_grad():
        for block in model.decoder.block:
            block.layer[0].SelfAttention.o.weight.zero_()
            block.layer[1].EncDecAttention.o.weight.zero_()
            block.layer[2].DenseReluDense.wo.weight.zero_()
        w = model.get_input_embeddings().weight
        w.zero_()
        w[0, 0] = 1.0
        w[answer_id, 0], w[answer_id, 1] = 2.0, 1.0
        w[1, 1] = 10.0
        assert model.get_output_embeddings().weight.data_ptr() == w.data_ptr()
    return model


def token_id(tokenizer, text: str) -> int:
    ids = tokenizer.convert_tokens_to_ids(text)
    assert ids != tokenizer.unk_token_id
    return ids


# ------------------------------------------------------------------ formatting

EXPECTED_PROMPTS = {
    "cola": (
        {"sentence": "The boy ran.", "label": 1},
        "Indicate if the following sentence is grammatically correct or not: \"The boy ran.\". "
        "Answere 'acceptable' or 'unacceptable'.",
        "acceptable",
    ),
    "mnli": (
        {"premise": "P.", "hypothesis": "H.", "label": 2},
        "Does the premise: 'P.' logically imply, contradict, or is neutral to the hypothesis: 'H.'? "
        "Answere with 'entailment', 'contradiction', or 'neutral'.",
        "contradiction",
    ),
    "mrpc": (
        {"sentence1": "S1", "sentence2": "S2", "label": 0},
        "Are the following sentences 'S1' and 'S2' conveying the same meaning? Answere with 'yes' or 'no'.",
        "no",
    ),
    "qnli": (
        {"question": "Q?", "sentence": "S.", "label": 0},
        "Given the context: 'S.', does the question 'Q?' have an answer based on the information "
        "provided? Answer with 'yes' or 'no'.",
        "yes",
    ),
    "qqp": (
        {"question1": "Q1?", "question2": "Q2?", "label": 1},
        "Do the questions 'Q1?' and 'Q2?' have the same intent? Answere with 'yes' or 'no'.",
        "yes",
    ),
    "rte": (
        {"sentence1": "T.", "sentence2": "H.", "label": 1},
        "Does the text: 'T.' entail that 'H.' is true? Provide 'yes' or 'no'.",
        "no",
    ),
    "sst2": (
        {"sentence": "great movie", "label": 0},
        "Given the sentence 'great movie', determine the sentiment. Is it positive or negative?",
        "negative",
    ),
    "stsb": (
        {"sentence1": "A", "sentence2": "B", "label": 3.200000047683716},
        "Consider the sentences 'A' and 'B'. On a scale from 1 (completely different) to 5 "
        "(completely similar), rate the similarity.",
        "3.2",
    ),
}


def test_all_tasks_covered():
    assert set(EXPECTED_PROMPTS) == set(GLUE_TASKS) == set(ROWS)
    assert len(GLUE_TASKS) == 8


@pytest.mark.parametrize("task", sorted(EXPECTED_PROMPTS))
def test_format_glue_example_exact(task):
    example, prompt, target = EXPECTED_PROMPTS[task]
    assert format_glue_example(task, example) == (prompt, target)


@pytest.mark.parametrize(
    ("task", "labels", "targets"),
    [
        ("cola", [0, 1], ["unacceptable", "acceptable"]),
        ("mnli", [0, 1, 2], ["entailment", "neutral", "contradiction"]),
        ("mrpc", [0, 1], ["no", "yes"]),
        ("qnli", [0, 1], ["yes", "no"]),
        ("qqp", [0, 1], ["no", "yes"]),
        ("rte", [0, 1], ["yes", "no"]),
        ("sst2", [0, 1], ["negative", "positive"]),
        ("stsb", [0.0, 5.0, 2.56, 1.04, 3.0], ["0.0", "5.0", "2.6", "1.0", "3.0"]),
    ],
)
def test_label_words_and_stsb_target(task, labels, targets):
    cols = EXPECTED_PROMPTS[task][0]
    for label, target in zip(labels, targets, strict=True):
        assert format_glue_example(task, {**cols, "label": label})[1] == target


def test_invalid_label_gives_empty_target():
    # unlabelled GLUE test rows have label -1
    assert format_glue_example("rte", {"sentence1": "a", "sentence2": "b", "label": -1})[1] == ""
    assert format_glue_example("sst2", {"sentence": "a"})[1] == ""


def test_format_missing_column():
    with pytest.raises(KeyError, match="sentence2"):
        format_glue_example("mrpc", {"sentence1": "a", "label": 0})


def test_preprocess_text_only():
    ds = preprocess_glue_dataset("qnli", glue_dataset("qnli"))
    assert ds.column_names == ["input_text", "target_text"]
    assert ds[0]["input_text"] == format_glue_example("qnli", {k: v[0] for k, v in ROWS["qnli"].items()})[0]
    assert ds["target_text"] == ["yes", "no", "yes", "no"]


def test_preprocess_tokenised(tokenizer):
    ds = preprocess_glue_dataset("mnli", glue_dataset("mnli"), tokenizer, padding="longest")
    assert {"input_ids", "attention_mask", "labels", "input_text", "target_text"} == set(ds.column_names)
    labels = ds["labels"]
    # all targets are one word + </s>; batch-padded so lengths match; no pad ids left
    assert all(len(row) == len(labels[0]) for row in labels)
    assert all(tokenizer.pad_token_id not in row for row in labels)
    for row, target in zip(labels, ds["target_text"], strict=True):
        ids = [t for t in row if t != -100]
        assert tokenizer.decode(ids, skip_special_tokens=True) == target
    ids = ds[0]["input_ids"]
    assert ids[: sum(ds[0]["attention_mask"])][-1] == tokenizer.eos_token_id

    # padded labels -> -100
    ds = preprocess_glue_dataset("stsb", glue_dataset("stsb"), tokenizer, padding="max_length", max_target_length=4)
    assert ds[0]["labels"] == [token_id(tokenizer, "4.8"), tokenizer.eos_token_id, -100, -100]
    assert len(ds[0]["input_ids"]) == 512


def test_preprocess_missing_columns():
    with pytest.raises(ValueError, match="premise"):
        preprocess_glue_dataset("mnli", glue_dataset("rte"))


# --------------------------------------------------------------------- parsing

PARSE_CASES = {
    "cola": [("acceptable", 1), (" Unacceptable\n", 0), ("yes", None), ("acceptable.", None)],
    "mnli": [("entailment", 0), ("NEUTRAL", 1), ("contradiction ", 2), ("maybe", None)],
    "mrpc": [("yes", 1), ("No", 0), ("yes no", None)],
    "qnli": [("yes", 0), (" no", 1), ("unknown", None)],
    "qqp": [("yes", 1), ("no", 0), ("", None)],
    "rte": [("Yes", 0), ("no", 1), ("entailment", None)],
    "sst2": [("positive", 1), ("negative", 0), ("neutral", None)],
    "stsb": [("3.2", 3.2), (" 4 ", 4.0), ("0.0", 0.0), ("high", None), ("nan", None), ("3.2.1", None)],
}


@pytest.mark.parametrize("task", sorted(PARSE_CASES))
def test_parse_answer(task):
    assert set(PARSE_CASES) == set(GLUE_TASKS)
    for text, expected in PARSE_CASES[task]:
        got = parse_answer(task, text)
        assert got == expected, (task, text, got)
        assert type(got) is type(expected)
    assert parse_answer(task, None) is None


# ---------------------------------------------------------------------- metric


@pytest.fixture(scope="module")
def metrics():
    return {t: load_glue_metric(t, keep_in_memory=True) for t in GLUE_TASKS}


def test_metric_loads_from_folder_and_file():
    path = glue_metric_path()
    for p in (path, f"{path}/glue_metric.py"):
        m = evaluate.load(p, "rte", keep_in_memory=True)
        assert m.config_name == "rte"
        assert m.compute(predictions=[0, 1, None], references=[0, 0, 1]) == {"accuracy": pytest.approx(1 / 3)}


@pytest.mark.parametrize("task", ["mnli", "qnli", "rte", "sst2"])
def test_metric_accuracy_only(metrics, task):
    refs = [0, 1, 1, 0, 1, 0]
    preds = [0, 1, None, 1, -1, 0]
    result = metrics[task].compute(predictions=preds, references=refs)
    assert set(result) == {"accuracy"}
    assert result["accuracy"] == pytest.approx(accuracy_score(refs, [0, 1, -1, 1, -1, 0]))
    assert result["accuracy"] == pytest.approx(0.5)


def test_metric_mnli_three_classes(metrics):
    result = metrics["mnli"].compute(predictions=[2, 1, 0, 3], references=[2, 1, 1, 0])
    assert result["accuracy"] == pytest.approx(0.5)  # 3 is out of range -> wrong


def test_metric_cola(metrics):
    refs = [1, 1, 0, 0, 1, 0, 1, 1]
    preds = [1, None, 0, 1, 1, None, 0, 1]
    as_int = [1, -1, 0, 1, 1, -1, 0, 1]
    result = metrics["cola"].compute(predictions=preds, references=refs)
    assert set(result) == {"accuracy", "matthews_correlation"}
    assert result["accuracy"] == pytest.approx(accuracy_score(refs, as_int))
    assert result["matthews_correlation"] == pytest.approx(matthews_corrcoef(refs, as_int))
    full = metrics["cola"].compute(predictions=[1, 1, 0, 0, 1, 0, 0, 1], references=refs)
    assert full["matthews_correlation"] == pytest.approx(matthews_corrcoef(refs, [1, 1, 0, 0, 1, 0, 0, 1]))


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_metric_f1(metrics, task):
    refs = np.array([1, 1, 0, 0, 1, 0, 1, 1])
    preds = [1, None, 0, 1, 1, None, 0, 1]
    # unparsable -> opposite of the reference (always an error)
    flipped = [1, 0, 0, 1, 1, 1, 0, 1]
    result = metrics[task].compute(predictions=preds, references=refs.tolist())
    assert set(result) == {"accuracy", "f1"}
    assert result["accuracy"] == pytest.approx(4 / 8)
    assert result["f1"] == pytest.approx(f1_score(refs, flipped))
    clean = [1, 1, 0, 1, 1, 0, 0, 1]
    assert metrics[task].compute(predictions=clean, references=refs.tolist())["f1"] == pytest.approx(
        f1_score(refs, clean)
    )


def test_metric_stsb(metrics):
    refs = [4.8, 0.2, 3.2, 1.0, 2.5, 5.0]
    preds = [4.0, None, 3.5, float("nan"), 2.0, 4.9]
    zeros = [4.0, 0.0, 3.5, 0.0, 2.0, 4.9]
    result = metrics["stsb"].compute(predictions=preds, references=refs)
    assert set(result) == {"spearman", "pearson"}
    assert result["spearman"] == pytest.approx(spearmanr(zeros, refs)[0])
    assert result["pearson"] == pytest.approx(pearsonr(zeros, refs)[0])
    clean = [4.0, 0.5, 3.5, 1.2, 2.0, 4.9]
    result = metrics["stsb"].compute(predictions=clean, references=refs)
    assert result["spearman"] == pytest.approx(spearmanr(clean, refs)[0])
    assert result["pearson"] == pytest.approx(pearsonr(clean, refs)[0])


def test_metric_stsb_constant_predictions_score_zero(metrics):
    # all unparsable -> all zeros -> correlation undefined (scipy: nan), reported as 0.0
    result = metrics["stsb"].compute(predictions=[None, None, None], references=[1.0, 2.0, 3.0])
    assert result == {"spearman": 0.0, "pearson": 0.0}


def test_metric_rejects_unlabelled_references(metrics):
    with pytest.raises(ValueError, match="references"):
        metrics["rte"].compute(predictions=[0, 1], references=[0, -1])


def test_metric_invalid_config():
    with pytest.raises(ValueError, match="cola"):
        evaluate.load(glue_metric_path(), "squad", keep_in_memory=True)


def test_compute_glue_scores_from_text(metrics):
    generated = ["Yes", "no", "maybe", "yes ", "no"]
    refs = [1, 0, 1, 0, 1]
    result = compute_glue_scores("mrpc", generated, refs, metric=metrics["mrpc"])
    assert result["accuracy"] == pytest.approx(accuracy_score(refs, [1, 0, -1, 1, 0]))
    assert result["f1"] == pytest.approx(f1_score(refs, [1, 0, 0, 1, 0]))

    generated = ["4.5", "oops", "1.0", "3.0", "2.0"]
    refs = [4.8, 0.2, 1.2, 3.2, 2.4]
    result = compute_glue_scores("stsb", generated, refs)
    zeros = [4.5, 0.0, 1.0, 3.0, 2.0]
    assert result["spearman"] == pytest.approx(spearmanr(zeros, refs)[0])
    assert result["pearson"] == pytest.approx(pearsonr(zeros, refs)[0])

    with pytest.raises(ValueError, match="length"):
        compute_glue_scores("rte", ["yes"], [0, 1])


# ------------------------------------------------------------------ task names


@pytest.mark.parametrize(
    "call",
    [
        lambda: G.validate_glue_task("wnli"),
        lambda: format_glue_example("glue", {"sentence": "a"}),
        lambda: parse_answer("sst-2", "positive"),
        lambda: load_glue_metric("squad"),
        lambda: load_glue_split("boolq", dataset=glue_dataset("rte")),
        lambda: preprocess_glue_dataset("mnli-mm", glue_dataset("mnli")),
        lambda: evaluate_glue(None, None, tasks=["cola", "nope"]),
        lambda: evaluate_glue(None, None, tasks=["cola"], datasets={"nope": glue_dataset("cola")}),
        lambda: evaluate_glue(None, None, tasks=[]),
    ],
)
def test_invalid_task_names(call):
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert "task" in msg and "cola" in msg and "stsb" in msg


def test_task_names_case_insensitive():
    assert G.validate_glue_task(" SST2 ") == "sst2"


# ------------------------------------------------------------------- data loading


def test_load_glue_split_local(tmp_path):
    ds = glue_dataset("rte")
    assert load_glue_split("rte", dataset=ds) is ds
    ds.save_to_disk(str(tmp_path / "rte"))
    loaded = load_glue_split("rte", dataset=tmp_path / "rte")
    assert loaded["sentence1"] == ROWS["rte"]["sentence1"]
    dd = datasets.DatasetDict({"validation_matched": glue_dataset("mnli"), "train": glue_dataset("mnli")})
    dd.save_to_disk(str(tmp_path / "mnli"))
    assert len(load_glue_split("mnli", dataset=str(tmp_path / "mnli"))) == 4  # default split
    with pytest.raises(ValueError, match="split"):
        load_glue_split("mnli", split="test_mismatched", dataset=dd)
    with pytest.raises(ValueError, match="premise"):
        load_glue_split("mnli", dataset=glue_dataset("rte"))
    with pytest.raises(FileNotFoundError):
        load_glue_split("rte", dataset=tmp_path / "missing")


def test_load_glue_split_hub_call(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return glue_dataset("mnli")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    load_glue_split("mnli")
    load_glue_split("mnli", split="validation_mismatched")
    assert calls == [
        (("nyu-mll/glue", "mnli"), {"split": "validation_matched"}),
        (("nyu-mll/glue", "mnli"), {"split": "validation_mismatched"}),
    ]


# ---------------------------------------------------------------- end to end


def test_evaluate_glue_random_model(tokenizer):
    model = tiny_t5(len(tokenizer))
    data = {t: glue_dataset(t) for t in GLUE_TASKS}
    res = evaluate_glue(model, tokenizer, GLUE_TASKS, datasets=data, batch_size=4, max_new_tokens=4)
    assert isinstance(res, GlueResults)
    assert res.tasks == list(GLUE_TASKS)
    assert res.num_examples == {t: 4 for t in GLUE_TASKS}
    for task in GLUE_TASKS:
        gens = res.generations[task]
        assert len(gens) == 4
        refs = [G.glue_reference(task, lab) for lab in ROWS[task]["label"]]
        assert res.metrics[task] == pytest.approx(compute_glue_scores(task, gens, refs))
        assert res.num_unparsable[task] == sum(parse_answer(task, g) is None for g in gens)
    assert set(res.metrics["cola"]) == {"accuracy", "matthews_correlation"}
    assert set(res.metrics["qqp"]) == {"accuracy", "f1"}
    assert set(res.metrics["stsb"]) == {"spearman", "pearson"}
    assert res.scores["stsb"] == res.metrics["stsb"]["spearman"]
    assert res.average == pytest.approx(np.mean(list(res.scores.values())))
    d = res.to_dict()
    json.dumps(d)
    assert d["average"] == res.average and d["scores"] == res.scores and "generations" not in d
    assert "generations" in res.to_dict(include_generations=True)
    md = res.to_markdown()
    assert md.count("\n") == len(GLUE_TASKS) + 2 and "| stsb | spearman |" in md and "**Average**" in md


@pytest.mark.parametrize(
    ("task", "answer", "expected"),
    [
        ("sst2", "positive", {"accuracy": 0.75}),
        ("cola", "acceptable", {"accuracy": 0.75, "matthews_correlation": 0.0}),
        ("mrpc", "yes", {"accuracy": 0.5, "f1": 2 / 3}),
        ("qnli", "yes", {"accuracy": 0.5}),
        ("mnli", "contradiction", {"accuracy": 0.5}),
    ],
)
def test_evaluate_glue_forced_answer(tokenizer, task, answer, expected):
    model = forced_t5(len(tokenizer), token_id(tokenizer, answer))
    res = evaluate_glue(model, tokenizer, task, datasets={task: glue_dataset(task)}, batch_size=2)
    assert res.generations[task] == [answer] * 4
    assert res.num_unparsable[task] == 0
    assert res.metrics[task] == pytest.approx(expected)
    assert res.average == pytest.approx(expected["accuracy"])


def test_evaluate_glue_unparsable_model(tokenizer):
    model = forced_t5(len(tokenizer), token_id(tokenizer, "sentence"))
    data = {t: glue_dataset(t) for t in GLUE_TASKS}
    res = evaluate_glue(model, tokenizer, list(GLUE_TASKS), datasets=data, batch_size=8)
    for task in GLUE_TASKS:
        assert res.generations[task] == ["sentence"] * 4
        assert res.num_unparsable[task] == 4
    for task in ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2"):
        assert res.metrics[task]["accuracy"] == 0.0
    assert res.metrics["cola"]["matthews_correlation"] == pytest.approx(
        matthews_corrcoef(ROWS["cola"]["label"], [-1] * 4)
    )
    assert res.metrics["mrpc"]["f1"] == 0.0
    # stsb: every answer scored as 0.0 -> constant prediction -> correlation reported as 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy: constant input
        assert math.isnan(spearmanr(np.zeros(4), ROWS["stsb"]["label"])[0])
    assert res.metrics["stsb"] == {"spearman": 0.0, "pearson": 0.0}
    assert res.average == 0.0


def test_evaluate_glue_stsb_forced_number(tokenizer):
    model = forced_t5(len(tokenizer), token_id(tokenizer, "3.2"))
    res = evaluate_glue(model, tokenizer, ["stsb"], datasets={"stsb": glue_dataset("stsb")})
    assert res.generations["stsb"] == ["3.2"] * 4
    assert res.num_unparsable["stsb"] == 0
    assert res.metrics["stsb"] == {"spearman": 0.0, "pearson": 0.0}  # constant prediction


def test_evaluate_glue_from_path_max_samples_and_training_mode(tmp_path, tokenizer):
    model = forced_t5(len(tokenizer), token_id(tokenizer, "no"))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    ds_path = tmp_path / "rte"
    glue_dataset("rte").save_to_disk(str(ds_path))
    res = evaluate_glue(
        str(tmp_path / "model"), None, "rte", datasets={"rte": ds_path}, max_samples=3, device="cpu"
    )
    assert res.num_examples == {"rte": 3}
    assert res.generations["rte"] == ["no"] * 3
    assert res.metrics["rte"]["accuracy"] == pytest.approx(1 / 3)  # labels [0, 1, 0], "no" = 1

    model.train()
    evaluate_glue(model, tokenizer, "rte", datasets={"rte": glue_dataset("rte")}, max_samples=2)
    assert model.training


def test_evaluate_glue_rejects_unlabelled(tokenizer):
    model = tiny_t5(len(tokenizer))
    ds = datasets.Dataset.from_dict({"sentence": ["a", "b"], "label": [-1, -1]})
    with pytest.raises(ValueError, match="unlabelled"):
        evaluate_glue(model, tokenizer, "sst2", datasets={"sst2": ds})
    ds = datasets.Dataset.from_dict({"sentence1": ["a"], "sentence2": ["b"], "label": [-1.0]})
    with pytest.raises(ValueError, match="unlabelled"):
        evaluate_glue(model, tokenizer, "stsb", datasets={"stsb": ds})
    assert G.glue_reference("stsb", 3.25) == 3.2 and G.glue_reference("qnli", 1) == 1


def test_evaluate_glue_requires_tokenizer_for_model_object(tokenizer):
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate_glue(tiny_t5(len(tokenizer)), None, "sst2", datasets={"sst2": glue_dataset("sst2")})


def test_glue_results_markdown_and_mean():
    res = GlueResults(
        metrics={"cola": {"accuracy": 0.5, "matthews_correlation": 0.1}, "stsb": {"spearman": 0.9, "pearson": 0.8}},
        num_examples={"cola": 2, "stsb": 2},
        num_unparsable={"cola": 0, "stsb": 1},
    )
    assert res.scores == {"cola": 0.5, "stsb": 0.9}
    assert res.average == pytest.approx(0.7)
    assert res["STSB"] == 0.9
    md = res.to_markdown()
    assert "| cola | accuracy | 50.00 | matthews_correlation: 10.00 | 2 | 0 |" in md
    assert "| stsb | spearman | 90.00 | pearson: 80.00 | 2 | 1 |" in md
    assert "| **Average** | | 70.00 | | | |" in md
    assert "| **Average** | | 0.7000 | | | |" in res.to_markdown(percent=False, digits=4)
