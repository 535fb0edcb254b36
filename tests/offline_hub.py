"""The documented fixture that lets the docs' code run offline, unchanged.

Every hub id the docs name is mapped to a tiny model or dataset **of the same kind**, written into a
private Hugging Face cache (`HF_HOME`) exactly where `from_pretrained` / `load_dataset` look for it
with `HF_HUB_OFFLINE=1`: models as hub snapshots (`hub/models--<org>--<name>/snapshots/<rev>/`),
datasets as prepared dataset caches (`datasets/<org>___<name>/<config>/0.0.0/<hash>/`). Nothing is
patched: the docs' code runs through the real transformers / datasets loading code.

| hub id(s) | stands in with |
|---|---|
| `openai/clip-vit-base-patch32` | a tiny random-init `CLIPModel`, `CLIPImageProcessor` (8×8 images) and a word-level tokenizer |
| `tanganke/clip-vit-base-patch32_<task>` (8 tasks) | a tiny `CLIPVisionModel`: the base's vision tower plus a seeded random task vector |
| the 8 CLIP task datasets (`tanganke/sun397`, …, `ufldl-stanford/svhn` `cropped_digits`, `ylecun/mnist`) | 12 random RGB images with labels, `train` and `test` splits |
| `google/flan-t5-base` | a tiny random-init FLAN-T5-geometry `T5ForConditionalGeneration` and a word-level tokenizer |
| `tanganke/flan-t5-base_glue-<task>` (8 GLUE tasks) | the base plus a seeded random task vector |
| `nyu-mll/glue` (every task's config) | 12 rows with the task's text columns, `label` and `idx`; `train` and the evaluation split |
| `laion/CLIP-ViT-B-32-laion2B-s34B-b79K` (open_clip, when open_clip is installed) | a tiny open_clip `CLIP` (8×8 images): `open_clip_config.json` + `open_clip_model.safetensors` |

`write_open_clip_experts(workdir)` also writes the fine-tuned experts that docs/open_clip.md reads from
its working directory (`finetuned/<task>`, open_clip folders: the stand-in base plus a seeded random
task vector), since such experts are the user's own rather than hub ids.

To add an id the docs use, add it to `MODELS` / `DATASETS` below.
"""  # noqa: E501 - the table's rows stay one line each

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import tempfile

import numpy as np
import torch

CLIP_TASKS = ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
CLIP_DATASETS = {
    "tanganke/sun397": None,
    "tanganke/stanford_cars": None,
    "tanganke/resisc45": None,
    "tanganke/eurosat": None,
    "ufldl-stanford/svhn": "cropped_digits",
    "tanganke/gtsrb": None,
    "ylecun/mnist": None,
    "tanganke/dtd": None,
}
REVISION = "0" * 40


def _snapshot(hf_home: str, kind: str, repo_id: str) -> str:
    root = os.path.join(hf_home, "hub", f"{kind}s--{repo_id.replace('/', '--')}")
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as handle:
        handle.write(REVISION)
    path = os.path.join(root, "snapshots", REVISION)
    os.makedirs(path, exist_ok=True)
    return path


def _word_tokenizer(words: list[str], bos: str, eos: str):
    """A tiny offline word-level tokenizer (unknown words map to <unk>); appends `eos`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {bos: 0, eos: 1, "<unk>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=eos,
                                   unk_token="<unk>")


def _clip_models(hf_home: str) -> None:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPVisionModel

    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                  patch_size=4)
    base = CLIPModel(CLIPConfig(vision_config=vision, text_config=text, projection_dim=8)).eval()
    path = _snapshot(hf_home, "model", "openai/clip-vit-base-patch32")
    base.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}).save_pretrained(path)
    _word_tokenizer(["a", "photo", "of", "the"], bos="<|startoftext|>", eos="<|endoftext|>").save_pretrained(path)
    for index, task in enumerate(CLIP_TASKS):
        expert = CLIPVisionModel(base.config.vision_config).eval()
        expert.load_state_dict(base.vision_model.state_dict())
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        expert.save_pretrained(_snapshot(hf_home, "model", f"tanganke/clip-vit-base-patch32_{task}"))


def _image_dataset(hf_home: str, repo_id: str, config: str | None, seed: int) -> None:
    """12 random RGB images with labels, train and test splits."""
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    splits = {}
    for split in ("train", "test"):
        images = [Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)) for _ in range(12)]
        splits[split] = Dataset.from_dict({"image": images, "label": [i % 3 for i in range(12)]})
    _prepared_dataset(hf_home, repo_id, config, splits)


def _prepared_dataset(hf_home: str, repo_id: str, config: str | None, splits: dict) -> None:
    """A prepared dataset cache for `repo_id`, as `load_dataset(repo_id, config)` finds it offline."""
    import datasets
    from datasets import DatasetDict, load_dataset_builder

    work = tempfile.mkdtemp()
    try:
        files = {}
        for split, dataset in DatasetDict(splits).items():
            files[split] = os.path.join(work, f"{split}.parquet")
            dataset.to_parquet(files[split])
        builder = load_dataset_builder("parquet", data_files=files, cache_dir=os.path.join(work, "cache"))
        builder.download_and_prepare()
        built = next(p for p in glob.glob(os.path.join(work, "cache", "parquet", "*", "*", "*")) if os.path.isdir(p))
        namespace, name = repo_id.split("/")
        target = os.path.join(hf_home, "datasets", f"{namespace}___{name}", config or "default", "0.0.0", "0" * 16)
        shutil.copytree(built, target)
        for file in os.listdir(target):  # the cache loader expects the dataset's own name in file names
            if file.startswith("parquet-"):
                os.rename(os.path.join(target, file), os.path.join(target, name + file[len("parquet"):]))
        info_path = os.path.join(target, "dataset_info.json")
        with open(info_path, encoding="utf-8") as handle:
            info = json.load(handle)
        info.update(config_name=config or "default", dataset_name=name)
        with open(info_path, "w", encoding="utf-8") as handle:
            json.dump(info, handle)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    datasets.disable_progress_bars()


GLUE_TASKS = ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]


def _flan_t5(hf_home: str) -> None:
    """`google/flan-t5-base`, its GLUE experts and `nyu-mll/glue` (every task, train and validation)."""
    from datasets import Dataset
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_featcal.evaluation.glue import GLUE_DEFAULT_SPLITS, GLUE_INPUT_COLUMNS, GLUE_LABEL_WORDS

    words = sorted({w for names in GLUE_LABEL_WORDS.values() for w in names} | {"the", "a", "cat", "sat", "1.0", "2.5"})
    tokenizer = _word_tokenizer(words, bos="<pad>", eos="</s>")
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    base = T5ForConditionalGeneration(config).eval()
    path = _snapshot(hf_home, "model", "google/flan-t5-base")
    base.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for index, task in enumerate(GLUE_TASKS):
        expert = copy.deepcopy(base)
        generator = torch.Generator().manual_seed(200 + index)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        expert.save_pretrained(_snapshot(hf_home, "model", f"tanganke/flan-t5-base_glue-{task}"))
        rows = 12
        columns = {c: [f"the cat sat {i}" for i in range(rows)] for c in GLUE_INPUT_COLUMNS[task]}
        labels = (
            [float(i % 5) for i in range(rows)]
            if task == "stsb"
            else [i % len(GLUE_LABEL_WORDS[task]) for i in range(rows)]
        )
        splits = {split: Dataset.from_dict({**columns, "label": labels, "idx": list(range(rows))})
                  for split in ("train", GLUE_DEFAULT_SPLITS[task])}
        _prepared_dataset(hf_home, "nyu-mll/glue", task, splits)


OPEN_CLIP_BASE = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
OPEN_CLIP_TASKS = ["eurosat", "dtd"]
_OPEN_CLIP_CFG = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 8, "layers": 2, "width": 16, "head_width": 8, "mlp_ratio": 2.0, "patch_size": 4},
    # open_clip's own tokenizer (the zero-shot heads use it): its full vocabulary
    "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


def _open_clip_folder(model, path: str) -> None:
    """An open_clip folder (`open_clip_config.json` + `open_clip_model.safetensors`), as the library saves one."""
    from hf_featcal.architectures.openclip import CONFIG_ATTRIBUTE, OpenCLIPVisionLayerMap

    preprocess = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}
    setattr(model, CONFIG_ATTRIBUTE, {"model_cfg": _OPEN_CLIP_CFG, "preprocess_cfg": preprocess})
    OpenCLIPVisionLayerMap().save_model(model, path)


def _open_clip_base():
    from open_clip.model import CLIP

    torch.manual_seed(0)
    return CLIP(**copy.deepcopy(_OPEN_CLIP_CFG)).eval()


def _open_clip_models(hf_home: str) -> None:
    _open_clip_folder(_open_clip_base(), _snapshot(hf_home, "model", OPEN_CLIP_BASE))


def write_open_clip_experts(workdir: str) -> None:
    """`finetuned/<task>` open_clip folders in `workdir`: the stand-in base plus seeded task vectors."""
    try:
        import open_clip  # noqa: F401
    except ImportError:
        return
    base = _open_clip_base()
    for index, task in enumerate(OPEN_CLIP_TASKS):
        expert = copy.deepcopy(base)
        generator = torch.Generator().manual_seed(200 + index)
        with torch.no_grad():
            for p in expert.visual.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        _open_clip_folder(expert, os.path.join(workdir, "finetuned", task))


def populate_offline_hub(hf_home: str) -> dict[str, str]:
    """Write every stand-in into `hf_home`; returns the environment to run the docs' code with."""
    _clip_models(hf_home)
    try:
        import open_clip  # noqa: F401
    except ImportError:
        pass
    else:
        _open_clip_models(hf_home)
    for seed, (repo_id, config) in enumerate(CLIP_DATASETS.items()):
        _image_dataset(hf_home, repo_id, config, seed)
    _flan_t5(hf_home)
    return {"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


__all__ = ["CLIP_DATASETS", "CLIP_TASKS", "OPEN_CLIP_BASE", "populate_offline_hub", "write_open_clip_experts"]
