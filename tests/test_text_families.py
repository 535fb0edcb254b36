"""The text families on the command line, offline: a tiny Llama recipe run end to end (`causal_lm`:
text and chat-message calibration data, held-out perplexity), a BERT merge and calibration
(`bert`), the merged folders carrying the base's tokenizer, and the recipe checks of the text keys.

Models and datasets come from examples/tiny_text_models.py (built from configs into a temp folder);
scores are checked against float64 forwards written here from the definition of perplexity, and the
command line's weights against the Python API on the same rows."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml

from hf_featcal import cli
from hf_featcal.recipes import RecipeError, parse_recipe
from test_downstream import TASK_YAML  # a local multiple-choice task for lm-evaluation-harness

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "recipes" / "tiny_llama_offline.yaml"


def _examples_module():
    spec = importlib.util.spec_from_file_location("tiny_text_models", ROOT / "examples" / "tiny_text_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _examples_module()


@pytest.fixture(scope="module")
def llama_world(tmp_path_factory):
    """tiny-llama/ (base with tokenizer, experts fine-tuned 2 steps, data) and the shipped recipe beside it."""
    root = tmp_path_factory.mktemp("llama-world")
    tiny.build_tiny_llama(str(root / "tiny-llama"), steps=2)
    shutil.copy(RECIPE, root / "recipe.yaml")
    return root


@pytest.fixture(scope="module")
def bert_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-world")
    tiny.build_tiny_bert(str(root))
    return root


def _state(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _vocab_ids(tokenizer, words: list[str]) -> list[int]:
    """Token ids by looking each word up in the vocabulary (not by running the tokenizer's pipeline)."""
    vocab = tokenizer.get_vocab()
    return [vocab[word] for word in words]


def _perplexity_float64(model, id_lists: list[list[int]]) -> float:
    """exp(mean over texts' predicted tokens of −log p(token | prefix)), each text alone, in float64."""
    model = model.double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in id_lists:
            logits = model(torch.tensor([ids])).logits[0]
            logprobs = torch.log_softmax(logits[:-1], dim=-1)
            total -= float(sum(logprobs[i, token] for i, token in enumerate(ids[1:])))
            count += len(ids) - 1
    return math.exp(total / count)


# ================================================================ the tiny-Llama recipe, end to end
def _test_ids(llama_world, tokenizer) -> dict[str, list[list[int]]]:
    """Task → the token ids of its test texts, as the recipe's evaluation reads them (by vocabulary
    lookup, not by the tokenizer's pipeline)."""
    test = {task: datasets.load_from_disk(str(llama_world / "tiny-llama" / "data" / task))["test"]
            for task in ("add", "sort")}
    return {
        "add": [_vocab_ids(tokenizer, ["<s>", *text.split()]) for text in test["add"]["text"]],
        # sort is evaluated like its calibration: messages rendered by the template, no <s> added
        "sort": [_vocab_ids(tokenizer, [word for message in row for word in
                                        [message["role"], ":", *message["content"].split(), "</s>"]])
                 for row in test["sort"]["messages"]],
    }


def test_tiny_llama_recipe_runs_end_to_end_offline(llama_world, capsys):
    """`hf-featcal run` on the shipped tiny-Llama recipe: merge, calibrate on text (add) and on chat messages
    (sort), perplexity before and after on the test splits, save with the base's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out = llama_world / "out"
    assert cli.main(["run", str(llama_world / "recipe.yaml"), "--output-dir", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out perplexity (lower is better), split test" in printed
    assert "(%)" not in printed.split("Feature drift")[0]  # perplexity is not a percentage

    # the folder carries the base's tokenizer (chat template included)
    base_dir = llama_world / "tiny-llama" / "base"
    saved, base_tokenizer = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(base_dir)
    assert saved("sort 3 1 =")["input_ids"] == _vocab_ids(base_tokenizer, ["<s>", "sort", "3", "1", "="])
    messages = [{"role": "user", "content": "add 1 2"}]
    assert saved.apply_chat_template(messages, tokenize=False) == "user : add 1 2 </s> "

    # held-out perplexity, recomputed in float64: the merge by its definition, the calibrated model as saved
    ids = _test_ids(llama_world, base_tokenizer)
    base = _state(base_dir)
    experts = {t: _state(llama_world / "tiny-llama" / "experts" / t) for t in ("add", "sort")}
    merged = LlamaForCausalLM.from_pretrained(base_dir)
    merged.load_state_dict({k: base[k] + 0.5 * sum(experts[t][k] - base[k] for t in experts) for k in base})
    calibrated = AutoModelForCausalLM.from_pretrained(out)
    scores = json.loads((out / "featcal_evaluation.json").read_text())
    for task in ("add", "sort"):
        assert scores["before"][task] == pytest.approx(_perplexity_float64(merged, ids[task]), rel=1e-4)
        assert scores["after"][task] == pytest.approx(_perplexity_float64(calibrated, ids[task]), rel=1e-4)
        assert scores["details"]["after"][task]["tokens"] == sum(len(i) - 1 for i in ids[task])
    assert scores["after"] != scores["before"]
    recipe = yaml.safe_load((out / "featcal_recipe.yaml").read_text())
    assert recipe["calibration"]["tasks"]["sort"]["messages_column"] == "messages"
    assert recipe["calibration"]["tasks"]["add"]["max_length"] == 32

    # `hf-featcal evaluate` on the saved folder: the same perplexities, chat messages included
    data = llama_world / "tiny-llama" / "data"
    scores_json = llama_world / "evaluate.json"
    assert cli.main(["evaluate", "--model", str(out), "--task", "sort", "--data", f"sort={data / 'sort'}",
                     "--messages-column", "messages", "--max-length", "32", "--output-json", str(scores_json)]) == 0
    assert "held-out perplexity (lower is better), split test" in capsys.readouterr().out
    evaluated = json.loads(scores_json.read_text())["scores"]
    assert evaluated["sort"] == pytest.approx(_perplexity_float64(calibrated, ids["sort"]), rel=1e-4)
    assert cli.main(["evaluate", "--model", str(out), "--task", "add", "--class-names", "add=a,b"]) == 2
    assert "only for CLIP models" in capsys.readouterr().err


def test_tiny_llama_recipe_with_svc_saves_svc_s_model(llama_world, capsys):
    """`post_merging: svc` on the tiny-Llama recipe: the saved model is SVC of the merge, and the reported
    perplexities are the saved model's, recomputed in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_featcal.merging import merge_models, singular_value_calibration
    from hf_featcal.merging.svc import svc_alpha_for

    recipe = yaml.safe_load((llama_world / "recipe.yaml").read_text())
    out = llama_world / "out-svc"
    recipe.update(post_merging="svc", output_dir=str(out))
    path = llama_world / "recipe-svc.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli.main(["run", str(path), "--quiet"]) == 0
    assert "+ svc" in capsys.readouterr().out

    world = llama_world / "tiny-llama"
    base = AutoModelForCausalLM.from_pretrained(world / "base")
    experts = {t: AutoModelForCausalLM.from_pretrained(world / "experts" / t) for t in ("add", "sort")}
    merged = merge_models(base, experts, recipe["merge"]["method"],
                          **{k: v for k, v in recipe["merge"].items() if k != "method"})
    want = singular_value_calibration(merged, base, experts, alpha=svc_alpha_for(recipe["merge"]["method"]))
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in want.state_dict().items())
    ids = _test_ids(llama_world, AutoTokenizer.from_pretrained(world / "base"))
    scores = json.loads((out / "featcal_evaluation.json").read_text())
    for task in ("add", "sort"):
        assert scores["after"][task] == pytest.approx(_perplexity_float64(saved, ids[task]), rel=1e-4)


def test_perplexity_pads_without_counting_padding(llama_world):
    """Texts of different lengths in one padded batch give the float64 per-text perplexity."""
    from transformers import LlamaForCausalLM

    from hf_featcal.evaluation.perplexity import perplexity

    model = LlamaForCausalLM.from_pretrained(llama_world / "tiny-llama" / "base")
    id_lists = [[1, 7, 9, 12], [1, 8, 10], [1, 7, 11, 12, 13, 9, 10], [1, 9]]
    result = perplexity(model, id_lists, pad_token_id=0, batch_size=3)
    assert result["tokens"] == sum(len(ids) - 1 for ids in id_lists)
    assert result["perplexity"] == pytest.approx(_perplexity_float64(model, id_lists), rel=1e-5)


def test_chat_messages_are_rendered_by_the_template_and_truncated(llama_world):
    """A messages column becomes the chat template's text, tokenised without added special tokens and cut
    at max_length; a text column gets the tokenizer's special tokens."""
    from transformers import AutoTokenizer

    from hf_featcal.families import get_family
    from hf_featcal.recipes import DatasetSpec

    tokenizer = AutoTokenizer.from_pretrained(llama_world / "tiny-llama" / "base")
    rows = datasets.Dataset.from_dict({
        "messages": [[{"role": "user", "content": "sort 2 1"}, {"role": "assistant", "content": "1 2"}]],
        "text": ["add 1 2 = 3"],
    })
    family = get_family("causal_lm")
    spec = DatasetSpec(dataset="unused", messages_column="messages", max_length=6)
    prepared = family.prepare_calibration("sort", rows, spec, {"tokenizer": tokenizer})
    assert prepared["input_ids"] == [_vocab_ids(tokenizer, ["user", ":", "sort", "2", "1", "</s>"])]
    spec = DatasetSpec(dataset="unused", text_column="text", max_length=None)
    prepared = family.prepare_calibration("add", rows, spec, {"tokenizer": tokenizer})
    assert prepared["input_ids"] == [_vocab_ids(tokenizer, ["<s>", "add", "1", "2", "=", "3"])]
    with pytest.raises(ValueError, match="no text column 'body'"):
        family.prepare_calibration("add", rows, DatasetSpec(dataset="unused", text_column="body"),
                                   {"tokenizer": tokenizer})


def test_merge_copies_the_llama_base_tokenizer(llama_world, capsys):
    from transformers import AutoTokenizer

    out = llama_world / "merged"
    argv = ["merge", "--base", str(llama_world / "tiny-llama" / "base"), "--output-dir", str(out),
            *[f"--expert={t}={llama_world / 'tiny-llama' / 'experts' / t}" for t in ("add", "sort")]]
    assert cli.main(argv) == 0
    assert "(with the base's tokenizer)" in capsys.readouterr().out
    base = AutoTokenizer.from_pretrained(llama_world / "tiny-llama" / "base")
    merged = AutoTokenizer.from_pretrained(out)
    assert merged.get_vocab() == base.get_vocab() and merged.chat_template == base.chat_template
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))


# ====================================================================== BERT from the command line
def test_bert_merge_and_calibrate_from_the_command_line(bert_world, capsys):
    """`merge` keeps the base's tokenizer; `calibrate` on text truncated to --max-length saves the weights the
    Python API computes from the same rows, and the tokenizer."""
    from transformers import AutoModel, AutoTokenizer

    from hf_featcal import FeatCalCalibrator, FeatCalConfig
    from hf_featcal.data import sample_examples

    experts = {t: str(bert_world / "experts" / t) for t in tiny.TASKS}
    expert_flags = [f"--expert={t}={path}" for t, path in experts.items()]
    merged_dir, out = bert_world / "merged", bert_world / "calibrated"
    assert cli.main(["merge", "--base", str(bert_world / "base"), *expert_flags, "--scaling-factor", "0.5",
                     "--output-dir", str(merged_dir)]) == 0
    assert "(with the base's tokenizer)" in capsys.readouterr().out
    base_tokenizer = AutoTokenizer.from_pretrained(bert_world / "base")
    assert AutoTokenizer.from_pretrained(merged_dir).get_vocab() == base_tokenizer.get_vocab()

    argv = ["calibrate", "--model", str(merged_dir), "--base", str(bert_world / "base"), *expert_flags,
            "--data-default", str(bert_world / "data" / "{task}"), "--num-examples", "16", "--max-length", "6",
            "--batch-size", "8", "--output-dir", str(out), "--quiet"]
    assert cli.main(argv) == 0
    assert "Feature drift per task" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(out)("add 1 2")["input_ids"] == _vocab_ids(
        base_tokenizer, ["[CLS]", "add", "1", "2", "[SEP]"])
    AutoModel.from_pretrained(out)

    # the Python API on the same 16 rows per task (FeatCalConfig.seed 42 draws them), tokenised by hand to 6
    # tokens ([CLS] + 4 words + [SEP])
    calibration = {}
    for task in tiny.TASKS:
        rows = sample_examples(datasets.load_from_disk(str(bert_world / "data" / task))["train"], 16, seed=42)
        ids = [_vocab_ids(base_tokenizer, ["[CLS]", *text.split()[:4], "[SEP]"]) for text in rows["text"]]
        calibration[task] = datasets.Dataset.from_dict({"input_ids": ids,
                                                        "attention_mask": [[1] * len(i) for i in ids]})
    reference = FeatCalCalibrator(AutoModel.from_pretrained(merged_dir), str(bert_world / "base"), experts,
                                  calibration, FeatCalConfig(batch_size=8, num_samples_per_task=None),
                                  processing_class=base_tokenizer,
                                  show_progress=False).calibrate()
    saved = _state(out)
    expected = {k: v for k, v in reference.state_dict().items() if k in saved}
    assert expected.keys() == saved.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(saved[k], v) for k, v in _state(merged_dir).items() if k in saved)


# ============================================================================== the recipe checks
_LLAMA = {"model_family": "causal_lm", "base": "org/llama", "experts": {"a": "org/llama-a", "b": "org/llama-b"},
          "merge": {"method": "task_arithmetic"}, "calibration": {"default": {"dataset": "org/{task}-text"}}}


def _with(recipe: dict, **changes) -> dict:
    out = json.loads(json.dumps(recipe))
    out.update(changes)
    return out


def test_text_recipe_keys_are_checked_before_anything_loads():
    bert = _with(_LLAMA, model_family="bert")
    assert parse_recipe(bert).evaluation is None  # no built-in evaluation: off unless asked for
    with pytest.raises(RecipeError, match="evaluation: model_family 'bert' has no built-in evaluation") as err:
        parse_recipe(_with(bert, evaluation={"split": "test"}))
    assert err.value.key == "evaluation"
    with pytest.raises(RecipeError) as err:
        parse_recipe(_with(bert, calibration={"default": {"dataset": "org/x", "messages_column": "messages"}}))
    assert err.value.key == "calibration.default.messages_column"
    assert "only for model_family 'causal_lm'" in err.value.reason
    with pytest.raises(RecipeError) as err:
        parse_recipe(_with(_LLAMA, calibration={"default": {"dataset": "org/x", "text_column": "t",
                                                            "messages_column": "m"}}))
    assert err.value.key == "calibration.default.messages_column" and "not both" in err.value.reason
    with pytest.raises(RecipeError) as err:
        parse_recipe(_with(_LLAMA, evaluation={"lm_eval_include_path": "."}))
    assert err.value.key == "evaluation.lm_eval_include_path" and "needs evaluation.lm_eval_tasks" in err.value.reason
    recipe = parse_recipe(_with(_LLAMA, calibration={"default": {"dataset": "org/x", "messages_column": "chat"}}))
    assert recipe.evaluation.datasets["a"].messages_column == "chat"  # evaluation reads what calibration read
    assert recipe.evaluation.datasets["a"].split == "test" and recipe.calibration["a"].max_length == 512


# ============================================================= lm-evaluation-harness tasks in a recipe


def _mc_docs() -> list[dict]:
    docs = []
    for a in range(4):
        for b in range(3):
            right = a + b
            docs.append({"question": f"add {a} {b} =", "choices": [str(right), str(right + 1), str(right + 2)],
                         "answer": 0})
    return docs


def _choice_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the words looked up in the vocabulary (the context after <s>, which the
    tokenizer adds and the harness keeps), summed in float64."""
    context_ids = _vocab_ids(tokenizer, ["<s>", *context.split()])
    continuation_ids = _vocab_ids(tokenizer, continuation.split())
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model.double()(ids).logits[0], dim=-1)
    return float(sum(logprobs[len(context_ids) - 1 + i, token] for i, token in enumerate(continuation_ids)))


@pytest.mark.slow
def test_a_recipe_scores_lm_eval_tasks_before_and_after(llama_world, capsys):
    """`evaluation.lm_eval_tasks` with a local task folder: the harness's accuracy before and after equals the
    argmax of float64 log-likelihoods of the merge and of the saved calibrated model."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tasks = llama_world / "lm_tasks"
    tasks.mkdir()
    docs = _mc_docs()
    (tasks / "add.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tasks / "featcal_tiny_mc.yaml").write_text(TASK_YAML.format(data=tasks / "add.jsonl"))
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["evaluation"] = {"split": "test", "lm_eval_tasks": ["featcal_tiny_mc"], "lm_eval_include_path": "lm_tasks"}
    (llama_world / "with_lm_eval.yaml").write_text(yaml.safe_dump(recipe))
    out = llama_world / "out-lm-eval"
    assert cli.main(["run", str(llama_world / "with_lm_eval.yaml"), "--output-dir", str(out), "--quiet"]) == 0
    assert "featcal_tiny_mc acc" in capsys.readouterr().out
    details = json.loads((out / "featcal_evaluation.json").read_text())["details"]

    base_dir = llama_world / "tiny-llama" / "base"
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = _state(base_dir)
    experts = {t: _state(llama_world / "tiny-llama" / "experts" / t) for t in ("add", "sort")}
    merged = LlamaForCausalLM.from_pretrained(base_dir)
    merged.load_state_dict({k: base[k] + 0.5 * sum(experts[t][k] - base[k] for t in experts) for k in base})
    for when, model in (("before", merged), ("after", AutoModelForCausalLM.from_pretrained(out))):
        correct = [max(range(len(doc["choices"])),
                       key=lambda i, doc=doc: _choice_loglikelihood(model, tokenizer, doc["question"],
                                                                    doc["choices"][i])) == doc["answer"]
                   for doc in docs]
        assert details[when]["lm_eval"]["featcal_tiny_mc"]["acc"] == pytest.approx(np.mean(correct)), when
