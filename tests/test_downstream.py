"""A saved folder that downstream tools take as it is (tiny models, offline).

Per family: merge tiny experts with Task Arithmetic, calibrate with FeatCal (processing class given),
`save_model`, then hand the folder to the downstream tool — lm-evaluation-harness (Llama), transformers'
Auto classes and `pipeline(...)` (Llama, CLIP, T5), open_clip (open_clip) — and check what it computes
against a direct computation with the in-memory calibrated model. Also the model card's hub metadata,
and the atomic save (injected write failures, stale shards).
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import datasets
import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import validate_repo_id
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    pipeline,
)

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.merging import merge_models
from testing_utils import perturbed, randomise_norms

REQUIRE_OPTIONAL = os.environ.get("HF_FEATCAL_REQUIRE_OPTIONAL") == "1"


def _import_lm_eval():
    if REQUIRE_OPTIONAL:  # CI installs the [lm_eval] extra: the harness test must run there
        import lm_eval

        return lm_eval
    return pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'hf_featcal[lm_eval]')")


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


def _check_card(folder) -> dict:
    """The card parses with huggingface_hub and passes its local metadata validation; returns the metadata.

    (`ModelCard.validate` posts the card to the hub's /api/validate-yaml, which needs the network; the
    local checks are `ModelCardData` built strictly from the metadata and repo-id validation.)"""
    card = ModelCard.load(os.path.join(folder, "README.md"))
    meta = card.data.to_dict()
    ModelCardData(**meta, ignore_metadata_errors=False)
    assert "merge" in meta["tags"]
    if "base_model" in meta:  # the merged models' hub ids, as the hub expects for a merge
        assert isinstance(meta["base_model"], list) and meta["base_model"]
        for parent in meta["base_model"]:
            validate_repo_id(parent)
        assert meta["base_model_relation"] == "merge"
    else:  # no hub id known: no relation to declare
        assert "base_model_relation" not in meta
    return meta


# ============================================================================================ Llama
LLAMA_WORDS = "sort add copy reverse = 0 1 2 3 4 5 6 7 8 9 yes no".split()


def llama_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in LLAMA_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=32)


def _hub_cache_folder(root, repo_id: str) -> str:
    """A folder laid out as huggingface_hub's cache lays out a downloaded snapshot."""
    return os.path.join(root, "hub", "models--" + repo_id.replace("/", "--"), "snapshots", "0123456789abcdef")


@pytest.fixture(scope="module")
def llama_saved(tmp_path_factory):
    """Base and experts as local folders (the documented offline way): the base's config records its hub
    id (as transformers 4 wrote `_name_or_path`) and its card a license; expert `add` is a hub-cache
    snapshot; expert `sort` a plain folder with no hub id."""
    root = tmp_path_factory.mktemp("llama")
    generator = torch.Generator().manual_seed(0)
    tokenizer = llama_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in base.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
    folders = {"base": str(root / "base"), "add": _hub_cache_folder(root, "featcal-tests/tiny-llama-add"),
               "sort": str(root / "sort")}
    base.save_pretrained(folders["base"])
    with open(os.path.join(folders["base"], "config.json")) as handle:
        recorded = json.load(handle)
    recorded["_name_or_path"] = "featcal-tests/tiny-llama-base"
    with open(os.path.join(folders["base"], "config.json"), "w") as handle:
        json.dump(recorded, handle)
    ModelCard("---\nlicense: mit\nlibrary_name: transformers\n---\n# tiny base\n").save(
        os.path.join(folders["base"], "README.md")
    )
    for task in ("add", "sort"):
        perturbed(base, generator, 0.03).save_pretrained(folders[task])

    merged = merge_models(folders["base"], {t: folders[t] for t in ("add", "sort")}, "task_arithmetic",
                          scaling_factor=0.5)
    uncalibrated = copy.deepcopy(merged).eval()
    rng = np.random.default_rng(0)
    calibration = {
        task: datasets.Dataset.from_dict({"text": [
            f"{task} " + " ".join(str(d) for d in rng.integers(0, 10, rng.integers(2, 6))) + " =" for _ in range(12)
        ]})
        for task in ("add", "sort")
    }
    calibrator = FeatCalCalibrator(
        merged, folders["base"], {t: folders[t] for t in ("add", "sort")}, calibration,
        FeatCalConfig(num_samples_per_task=12, batch_size=4), processing_class=tokenizer, show_progress=False,
    )
    calibrator.calibrate()
    out = root / "calibrated"
    calibrator.save_model(out)
    return {"out": str(out), "model": calibrator.model.eval(), "uncalibrated": uncalibrated, "tokenizer": tokenizer,
            "root": root}


def test_llama_folder_loads_with_auto_classes_and_pipeline(llama_saved):
    out, model, tokenizer = llama_saved["out"], llama_saved["model"], llama_saved["tokenizer"]
    files = _files(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "featcal_config.json", "featcal_drift_report.json"} <= set(files)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    text = "sort 3 1 2 ="
    assert reloaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # the card's pipeline tag is a pipeline that runs the folder as it is; greedy output = the model's own
    meta = _check_card(out)
    generator = pipeline(meta["pipeline_tag"], model=out, device="cpu")
    produced = generator(text, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    with torch.no_grad():
        direct = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert produced.split() == tokenizer.decode(direct[0, ids.shape[1]:], skip_special_tokens=True).split()


def test_llama_card_metadata_follows_the_hub_merge_conventions(llama_saved):
    meta = _check_card(llama_saved["out"])
    # hub ids only: the base (its config's _name_or_path) and the hub-cache expert; the plain folder is not
    assert meta["base_model"] == ["featcal-tests/tiny-llama-base", "featcal-tests/tiny-llama-add"]
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == "transformers"
    assert meta["license"] == "mit"  # carried over from the base's card
    assert meta["featcal"]["experts"] == {"add": "featcal-tests/tiny-llama-add", "sort": None}
    text = ModelCard.load(os.path.join(llama_saved["out"], "README.md")).text
    assert "local folder `sort` (no hub id recorded)" in text
    assert "- `add`: featcal-tests/tiny-llama-add\n" in text
    assert "featcal-tests/tiny-llama-base (local folder `base`)" in text
    assert str(llama_saved["root"]) not in ModelCard.load(os.path.join(llama_saved["out"], "README.md")).content


# lm-evaluation-harness: a local JSON multiple-choice task
MC_DOCS = [
    {"question": "sort 3 1 2 =", "choices": ["1 2 3", "3 2 1", "2 1 3"], "answer": 0},
    {"question": "add 2 2 =", "choices": ["4", "5", "2 2"], "answer": 0},
    {"question": "copy 7 8 =", "choices": ["7 8", "8 7", "no"], "answer": 0},
    {"question": "reverse 1 2 3 =", "choices": ["3 2 1", "1 2 3"], "answer": 0},
    {"question": "sort 9 0 =", "choices": ["0 9", "9 0", "yes", "no"], "answer": 1},
]
TASK_YAML = """task: featcal_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def _continuation_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by a plain forward: the sum over the continuation's tokens."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    continuation_ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    return float(sum(logprobs[len(context_ids) - 1 + i, token] for i, token in enumerate(continuation_ids)))


@pytest.mark.slow
def test_lm_eval_harness_scores_the_saved_folder(llama_saved, tmp_path):
    """`lm_eval.simple_evaluate(model="hf")` on the saved folder with a local JSON task: its per-choice
    log-likelihoods, acc and acc_norm equal a direct computation with the calibrated model (and differ
    from the uncalibrated merge's, so the harness scored the calibrated weights)."""
    _import_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "featcal_tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    results = simple_evaluate(
        model="hf", model_args={"pretrained": llama_saved["out"], "dtype": "float32"}, tasks=["featcal_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)), num_fewshot=0, batch_size=2, device="cpu", log_samples=True,
    )
    model, uncalibrated, tokenizer = llama_saved["model"], llama_saved["uncalibrated"], llama_saved["tokenizer"]
    samples = sorted(results["samples"]["featcal_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    acc, acc_norm, largest_change, largest_gap = [], [], 0.0, 0.0
    for sample, doc in zip(samples, MC_DOCS, strict=True):
        harness = [float(resp[0][0]) for resp in sample["resps"]]
        direct = [_continuation_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        before = [
            _continuation_loglikelihood(uncalibrated, tokenizer, doc["question"], " " + c) for c in doc["choices"]
        ]
        np.testing.assert_allclose(harness, direct, rtol=0, atol=1e-4)
        largest_gap = max(largest_gap, max(abs(a - b) for a, b in zip(harness, direct, strict=True)))
        largest_change = max(largest_change, max(abs(a - b) for a, b in zip(direct, before, strict=True)))
        acc.append(float(np.argmax(direct) == doc["answer"]))
        acc_norm.append(
            float(np.argmax([ll / len(c) for ll, c in zip(direct, doc["choices"], strict=True)]) == doc["answer"])
        )
    assert largest_change > 1e-3
    scores = results["results"]["featcal_tiny_mc"]
    assert scores["acc,none"] == pytest.approx(np.mean(acc))
    assert scores["acc_norm,none"] == pytest.approx(np.mean(acc_norm))
    print(f"\nlm-eval acc {scores['acc,none']:.3f} acc_norm {scores['acc_norm,none']:.3f}; "
          f"direct acc {np.mean(acc):.3f} acc_norm {np.mean(acc_norm):.3f}; max |harness - direct| log-likelihood "
          f"{largest_gap:.2e}; max change by calibration {largest_change:.3f}")
    for sample, doc in zip(samples, MC_DOCS, strict=True):
        direct = [_continuation_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        print(doc["question"], [round(float(r[0][0]), 5) for r in sample["resps"]], [round(d, 5) for d in direct])


# ============================================================================================= CLIP
CLIP_WORDS = "this is a photo of red green blue square circle .".split()


def clip_processor() -> CLIPProcessor:
    vocab = {"<bos>": 0, "<eos>": 1, "<unk>": 2}
    for word in CLIP_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                           special_tokens=[("<bos>", 0), ("<eos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<eos>", unk_token="<unk>", model_max_length=16)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _images(n: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)) for _ in range(n)]


def tiny_clip_model(processor: CLIPProcessor, generator: torch.Generator) -> CLIPModel:
    """A tiny random-init CLIPModel for `processor`'s vocabulary and 8×8 images, norms randomised."""
    torch.manual_seed(1)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=len(processor.tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=1,
                max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                  patch_size=4)
    base = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    randomise_norms(base, generator)
    return base


@pytest.fixture(scope="module")
def clip_saved(tmp_path_factory):
    """A CLIPModel merge; the base in memory as loaded from the hub (its `_name_or_path` a hub id)."""
    root = tmp_path_factory.mktemp("clip")
    generator = torch.Generator().manual_seed(1)
    processor = clip_processor()
    base = tiny_clip_model(processor, generator)
    base.config._name_or_path = "featcal-tests/tiny-clip"
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cars", "dtd")}
    merged = merge_models(base, experts, "task_arithmetic", scaling_factor=0.5)
    data = {t: [{"pixel_values": processor.image_processor(_images(6, seed=i), return_tensors="pt")["pixel_values"]}]
            for i, t in enumerate(experts)}
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(batch_size=6), processing_class=processor,
                                   show_progress=False)
    calibrator.calibrate()
    out = root / "calibrated"
    calibrator.save_model(out)
    return {"out": str(out), "model": calibrator.model.eval(), "processor": processor}


def test_clip_folder_runs_zero_shot_pipeline(clip_saved):
    out, model, processor = clip_saved["out"], clip_saved["model"], clip_saved["processor"]
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "README.md"} <= set(
        _files(out)
    )
    reloaded = CLIPModel.from_pretrained(out).eval()
    reloaded_processor = CLIPProcessor.from_pretrained(out)
    labels = ["red square", "green circle", "blue square"]
    prompts = [f"This is a photo of {label}." for label in labels]  # the pipeline's default hypothesis template
    image = _images(1, seed=7)[0]
    inputs = processor(text=prompts, images=image, return_tensors="pt", padding=True)
    with torch.no_grad():
        direct = model(**inputs).logits_per_image.softmax(dim=-1)[0]
        again = reloaded(**reloaded_processor(text=prompts, images=image, return_tensors="pt", padding=True))
    torch.testing.assert_close(again.logits_per_image.softmax(dim=-1)[0], direct)
    meta = _check_card(out)
    assert meta["pipeline_tag"] == "zero-shot-image-classification"
    assert meta["base_model"] == ["featcal-tests/tiny-clip"]
    classifier = pipeline(meta["pipeline_tag"], model=out, device="cpu")
    scores = {row["label"]: row["score"] for row in classifier(image, candidate_labels=labels)}
    np.testing.assert_allclose([scores[label] for label in labels], direct.numpy(), rtol=0, atol=1e-5)
    assert float(direct.max() - direct.min()) > 1e-3  # the labels are told apart: a non-trivial comparison


# =============================================================================================== T5
T5_WORDS = "cola sst2 sentence : good bad acceptable unacceptable positive negative movie the was".split()


def t5_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in T5_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def t5_saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    generator = torch.Generator().manual_seed(2)
    tokenizer = t5_tokenizer()
    torch.manual_seed(2)
    config = T5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                      num_heads=2, feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    base = T5ForConditionalGeneration(config).eval()
    base.config._name_or_path = "featcal-tests/tiny-flan-t5"  # as loaded from the hub
    with torch.no_grad():
        for module in base.modules():
            if type(module).__name__ == "T5LayerNorm":
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cola", "sst2")}
    merged = merge_models(base, experts, "task_arithmetic", scaling_factor=0.5)
    sources = {"cola": ["cola sentence : the movie was good", "cola sentence : good bad"],
               "sst2": ["sst2 sentence : the movie was bad", "sst2 sentence : good"]}
    targets = {"cola": ["acceptable", "unacceptable"], "sst2": ["negative", "positive"]}
    data = {}
    for task in experts:
        batch = tokenizer(sources[task], return_tensors="pt", padding=True)
        labels = tokenizer(targets[task], return_tensors="pt", padding=True)["input_ids"]
        data[task] = [{**batch, "labels": labels.masked_fill(labels == 0, -100)}]
    calibrator = FeatCalCalibrator(merged, base, experts, data, processing_class=tokenizer, show_progress=False)
    calibrator.calibrate()
    out = root / "calibrated"
    # the base's hub card, as a download leaves it in the hub cache: its license is read from there, offline
    snapshot = _hub_cache_folder(root, "featcal-tests/tiny-flan-t5")
    os.makedirs(snapshot)
    ModelCard("---\nlicense: apache-2.0\n---\n# tiny flan-t5\n").save(os.path.join(snapshot, "README.md"))
    os.makedirs(os.path.join(root, "hub", "models--featcal-tests--tiny-flan-t5", "refs"))
    with open(os.path.join(root, "hub", "models--featcal-tests--tiny-flan-t5", "refs", "main"), "w") as handle:
        handle.write(os.path.basename(snapshot))
    with pytest.MonkeyPatch.context() as patch:
        import huggingface_hub.constants

        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
        calibrator.save_model(out)
    return {"out": str(out), "model": calibrator.model.eval(), "tokenizer": tokenizer}


def test_t5_folder_generates_with_auto_classes(t5_saved):
    """transformers 5 removed the `text2text-generation` pipeline (`transformers.pipelines.REMOVED_TASKS`):
    what it did — AutoTokenizer + AutoModelForSeq2SeqLM + generate — runs on the folder as it is."""
    out, model, tokenizer = t5_saved["out"], t5_saved["model"], t5_saved["tokenizer"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(
        _files(out)
    )
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    inputs = reloaded_tokenizer(["cola sentence : the movie was good"], return_tensors="pt")
    assert (
        inputs["input_ids"].tolist()
        == tokenizer(["cola sentence : the movie was good"], return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():
        produced = reloaded.generate(**inputs, max_new_tokens=5, do_sample=False)
        direct = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert produced.tolist() == direct.tolist()
    meta = _check_card(out)
    assert (
        meta["pipeline_tag"] == "text2text-generation"
    )  # transformers' own task mapping for T5ForConditionalGeneration
    assert meta["base_model"] == ["featcal-tests/tiny-flan-t5"]  # in-memory experts have no hub id: text only
    assert meta["featcal"]["experts"] == {"cola": None, "sst2": None}
    assert meta["license"] == "apache-2.0"  # from the base's card in the local hub cache


# =========================================================================================== open_clip
def test_open_clip_folder_records_its_preprocess(tmp_path):
    """open_clip keeps its preprocessing in open_clip_config.json: the folder's transform, as open_clip
    builds it, gives the same tensors as the preprocess given to the calibrator; nothing is warned."""
    if REQUIRE_OPTIONAL:
        import open_clip
    else:
        open_clip = pytest.importorskip("open_clip")
    from hf_featcal.architectures.openclip import CONFIG_NAME, load_open_clip, load_open_clip_processing

    cfg = {"embed_dim": 8, "quick_gelu": True,
           "vision_cfg": {"image_size": 8, "layers": 2, "width": 16, "head_width": 8, "mlp_ratio": 2.0,
                          "patch_size": 4},
           "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
    (tmp_path / "featcal-downstream-vit.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / "featcal-downstream-vit.json")
    generator = torch.Generator().manual_seed(3)
    # a checkpoint with its own (non-default) preprocessing, as open_clip records it on the model
    cfg["preprocess_cfg"] = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "interpolation": "bilinear"}
    base = load_open_clip("featcal-downstream-vit", force_preprocess_cfg=cfg["preprocess_cfg"])
    randomise_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cars", "dtd")}
    merged = merge_models(base, experts, "task_arithmetic", scaling_factor=0.5)
    preprocess = open_clip.image_transform(8, is_train=False, mean=cfg["preprocess_cfg"]["mean"],
                                           std=cfg["preprocess_cfg"]["std"], interpolation="bilinear")
    calibration = {t: datasets.Dataset.from_dict({"image": _images(6, seed=i)}) for i, t in enumerate(experts)}
    calibrator = FeatCalCalibrator(merged, base, experts, calibration, FeatCalConfig(batch_size=6),
                                   processing_class=preprocess, show_progress=False)
    calibrator.calibrate()
    out = tmp_path / "calibrated"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        calibrator.save_model(out)
    saved = json.loads((out / CONFIG_NAME).read_text())
    assert saved["preprocess_cfg"]["mean"] == cfg["preprocess_cfg"]["mean"]
    _, folder_preprocess = load_open_clip_processing(f"local-dir:{out}")
    _, _, open_clip_preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    image = _images(1, seed=9)[0]
    torch.testing.assert_close(folder_preprocess(image), preprocess(image))
    torch.testing.assert_close(open_clip_preprocess(image), preprocess(image))
    assert not torch.allclose(open_clip.image_transform(8, is_train=False)(image), preprocess(image))
    meta = _check_card(out)
    assert meta["library_name"] == "open_clip" and meta["pipeline_tag"] == "zero-shot-image-classification"
    assert "base_model" not in meta  # open_clip models built in memory record no hub id


# ====================================================================== a bare vision tower (CLIPVisionModel)
def test_vision_tower_folder_runs_image_feature_extraction(clip_setting, tmp_path):
    """A bare backbone's card names the feature-extraction pipeline of its modality, which runs the
    folder (image processor given to `save_model`) and returns the model's own features."""
    from transformers import LlamaModel

    from hf_featcal.report import pipeline_tag_of

    base, experts, merged, data = clip_setting
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(num_samples_per_task=10),
                                   show_progress=False)
    calibrator.calibrate()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    out = tmp_path / "tower"
    calibrator.save_model(out, processing_class=image_processor)
    assert "preprocessor_config.json" in _files(out)
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert meta["pipeline_tag"] == "image-feature-extraction"
    image = _images(1, seed=4)[0]
    features = pipeline(meta["pipeline_tag"], model=str(out), device="cpu")(image, return_tensors=True)
    with torch.no_grad():
        direct = calibrator.model(**image_processor(image, return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(torch.as_tensor(features).reshape(direct.shape), direct)
    tiny_llama = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2)
    assert pipeline_tag_of(LlamaModel(tiny_llama)) == "feature-extraction"
