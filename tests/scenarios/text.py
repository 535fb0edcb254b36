"""A small, offline seq2seq multi-task scenario with tiny T5 models, for tests and benchmarks (on the
shared base of :mod:`hf_featcal.scenarios.base`).

It mirrors the paper's FLAN-T5 / GLUE setting at toy scale: text-to-text tasks with prompt
prefixes (like GLUE templates), a "pretrained" T5 base that already knows the prompts, one fully
fine-tuned expert per task, their Task Arithmetic merge, exact-match scoring of greedy generations.
Everything is built offline from a seed, in about 30 s on one CPU thread.

- **Tokenizer**: a `tokenizers` WordLevel model with a whitespace pre-tokenizer over a fixed
  vocabulary (``<pad>`` = 0 is T5's pad and decoder-start token, ``</s>`` = 1 the eos, ``<unk>`` = 2;
  then task prefixes, digits, label words), wrapped in a `PreTrainedTokenizerFast` whose
  post-processor appends ``</s>``.
- **Tasks** (:data:`TASKS`) over sequences of 3–6 digits: they share the inputs and vocabulary but
  need different behaviour (``min`` and ``max`` even give opposite answers on the same digits):
  ``"sort: 3 1 4" -> "1 3 4"`` (sequence output), ``"min: 3 1 4" -> "1"``, ``"max: 3 1 4" -> "4"``
  (one-token answers) and ``"count: 3 1 4" -> "three"`` (a label word, as in GLUE templates).
- **Base**: a random-init `T5ForConditionalGeneration` with FLAN-T5 geometry (gated-GELU FFN,
  untied embeddings and LM head; d_model 64, 2+2 layers, ~200k parameters), pretrained briefly on a
  mix of generic proxy tasks (:data:`PRETRAIN_TASKS`: ``copy:`` a sequence, ``shift:`` every digit by
  one, 3–6 digits) and the target tasks on *short inputs only* (``pretrain_target_max_length`` = 3
  digits, drawn from the target tasks' train splits). Like FLAN-T5 on GLUE, the base knows the
  prompts and partly solves the tasks (≈ 45–55 % mean exact match), but does not generalise to
  longer inputs (``count`` ≈ 16 %, ``sort`` ≈ 30–36 %).
- **Experts**: the base fully fine-tuned on one task each (AdamW, 3–6 digit inputs): ≈ 100 % on
  their task, while they forget the others.
- **Merge**: Task Arithmetic at 0.3 (`hf_featcal.merging.task_arithmetic`) lands near the base
  (≈ 47–58 % mean; ``sort`` ≈ 0–5 %, ``count`` ≈ 16–33 %): 40–50 points below the experts. FeatCal
  (default config, base as anchor, 64 train examples per task) lifts it to ≈ 63–71 % (seeds 0–2).
  FeatCal warns that block-0 input Grams are singular: with a 38-word vocabulary the first blocks
  see few distinct inputs; the ridge settles those directions.

Use :func:`build_text_scenario` for everything at once, :meth:`TextScenario.evaluate` /
:func:`evaluate_exact_match` for scores and ``TextScenario.calibration_batches`` as FeatCal calibration
data (drawn from the train splits only). ``cd tests && python -m scenarios.text`` prints the score
table (base, experts, TA merge and, where T5 calibration is supported, TA + FeatCal).

The generator also knows harder positional tasks (``reverse``, ``rotate``) and ``first``, ``last``,
``parity`` (:data:`EXTRA_TASKS`); a tiny T5 does not learn ``reverse``/``rotate`` reliably within
the default budget (70–95 % after 400 steps, seed-dependent) and sum ``parity`` not at all, hence
the default task set.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from hf_featcal.scenarios.base import MergingScenario, build_or_load, load_models, save_build

__all__ = [
    "DIGITS",
    "EXTRA_TASKS",
    "NUMBER_WORDS",
    "PRETRAIN_TASKS",
    "TASKS",
    "VOCABULARY",
    "TextExample",
    "TextScenario",
    "TextScenarioConfig",
    "build_calibration_batches",
    "build_calibration_dataset",
    "build_text_scenario",
    "build_text_tokenizer",
    "build_tiny_t5",
    "build_or_load_models",
    "collate_examples",
    "evaluate_exact_match",
    "generate_task_examples",
    "make_task_example",
    "sample_examples",
    "train_on_pairs",
    "train_seq2seq",
]

#: Target tasks: one expert each; the merge should solve all of them.
TASKS: tuple[str, ...] = ("sort", "min", "max", "count")
#: Generic "pretraining" proxy tasks of the base model (never targets).
PRETRAIN_TASKS: tuple[str, ...] = ("copy", "shift")
#: Sequence symbols.
DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))
#: Number words used by the ``count`` task (index = number).
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

#: Further tasks the data generator knows (not used by the default scenario).
EXTRA_TASKS: tuple[str, ...] = ("reverse", "rotate", "first", "last", "parity")

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"
_SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
_LABEL_WORDS: tuple[str, ...] = NUMBER_WORDS + ("odd", "even")
_PREFIXES: tuple[str, ...] = tuple(f"{t}:" for t in PRETRAIN_TASKS + TASKS + EXTRA_TASKS)
#: The fixed vocabulary, in id order.
VOCABULARY: tuple[str, ...] = _SPECIAL_TOKENS + _PREFIXES + DIGITS + _LABEL_WORDS
assert len(set(VOCABULARY)) == len(VOCABULARY), "duplicate vocabulary entries"

_CACHE_FORMAT = 1  # bump when a change to this module changes what a build produces


# --------------------------------------------------------------------------------------------- tokenizer
def build_text_tokenizer() -> Any:
    """The offline word-level tokenizer of the scenario (a `transformers.PreTrainedTokenizerFast`).

    Ids are positions in :data:`VOCABULARY`: ``<pad>`` 0 (T5's pad and decoder start), ``</s>`` 1
    (eos, appended to every encoded text by the post-processor), ``<unk>`` 2, then task prefixes,
    digits and label words. Words are split on whitespace; unknown words map to ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(VOCABULARY)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, vocab[EOS_TOKEN])],
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=64,
        padding_side="right",
    )
    return tokenizer


# --------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class TextExample:
    """One text-to-text example: ``source`` (prompt-prefixed input) -> ``target``."""

    task: str
    source: str
    target: str


def _answer(task: str, digits: Sequence[int]) -> str:
    if task == "copy":
        out: Sequence[Any] = digits
    elif task == "shift":
        out = [(d + 1) % 10 for d in digits]
    elif task == "reverse":
        out = list(reversed(digits))
    elif task == "rotate":
        out = list(digits[1:]) + [digits[0]]
    elif task == "sort":
        out = sorted(digits)
    elif task == "max":
        out = [max(digits)]
    elif task == "min":
        out = [min(digits)]
    elif task == "first":
        out = [digits[0]]
    elif task == "last":
        out = [digits[-1]]
    elif task == "count":
        return NUMBER_WORDS[len(digits)]
    elif task == "parity":
        return "odd" if sum(digits) % 2 else "even"
    else:
        raise ValueError(f"unknown task {task!r}; known: {PRETRAIN_TASKS + TASKS + EXTRA_TASKS}")
    return " ".join(str(d) for d in out)


def make_task_example(task: str, digits: Sequence[int]) -> TextExample:
    """The example of `task` on the digit sequence `digits` (e.g. ``sort`` of ``[3, 1, 4]`` is
    ``"sort: 3 1 4" -> "1 3 4"``)."""
    return TextExample(task, f"{task}: " + " ".join(str(d) for d in digits), _answer(task, digits))


def generate_task_examples(
    task: str,
    num_train: int,
    num_test: int,
    seed: int = 0,
    min_length: int = 3,
    max_length: int = 6,
) -> tuple[list[TextExample], list[TextExample]]:
    """Deterministic, disjoint train/test examples of one task.

    Digit sequences of length `min_length`..`max_length` (uniform) are drawn from
    ``random.Random(f"{seed}-{task}")``; duplicates are skipped, so no test input appears in train.
    """
    if not 1 <= min_length <= max_length <= 9:
        raise ValueError(f"need 1 <= min_length <= max_length <= 9, got {min_length}, {max_length}")
    rng = random.Random(f"{seed}-{task}")
    seen: set[tuple[int, ...]] = set()
    sequences: list[tuple[int, ...]] = []
    total = num_train + num_test
    attempts = 0
    while len(sequences) < total:
        attempts += 1
        if attempts > 100 * total + 1000:
            raise ValueError(f"cannot draw {total} distinct sequences for {task!r}")
        length = rng.randint(min_length, max_length)
        digits = tuple(rng.randrange(10) for _ in range(length))
        if digits in seen:
            continue
        seen.add(digits)
        sequences.append(digits)
    examples = [make_task_example(task, s) for s in sequences]
    return examples[:num_train], examples[num_train:]


def _encode(tokenizer: Any, examples: Sequence[TextExample]) -> list[tuple[list[int], list[int]]]:
    sources = tokenizer([e.source for e in examples])["input_ids"]
    targets = tokenizer([e.target for e in examples])["input_ids"]
    return list(zip(sources, targets, strict=True))


def collate_examples(tokenizer: Any, examples: Sequence[TextExample]) -> dict[str, Tensor]:
    """A T5 batch ``{input_ids, attention_mask, labels}`` of `examples`, padded to the longest
    (labels padded with -100; the model makes its decoder inputs by shifting them right)."""
    return _collate_ids(_encode(tokenizer, examples), tokenizer.pad_token_id)


def _collate_ids(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    source_len = max(len(s) for s, _ in pairs)
    target_len = max(len(t) for _, t in pairs)
    input_ids = torch.full((len(pairs), source_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), source_len), dtype=torch.long)
    labels = torch.full((len(pairs), target_len), -100, dtype=torch.long)
    for row, (source, target) in enumerate(pairs):
        input_ids[row, : len(source)] = torch.tensor(source)
        attention_mask[row, : len(source)] = 1
        labels[row, : len(target)] = torch.tensor(target)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_calibration_batches(
    tokenizer: Any,
    examples: Sequence[TextExample],
    num_samples: int = 64,
    batch_size: int = 16,
    seed: int = 0,
) -> list[dict[str, Tensor]]:
    """FeatCal calibration batches of one task: `num_samples` examples drawn (without replacement,
    seeded) from `examples` — pass the TRAIN split — in batches of `batch_size`."""
    chosen = sample_examples(examples, num_samples, seed)
    return [collate_examples(tokenizer, chosen[i : i + batch_size]) for i in range(0, num_samples, batch_size)]


def sample_examples(examples: Sequence[TextExample], num_samples: int, seed: int) -> list[TextExample]:
    """`num_samples` of `examples` drawn without replacement by ``random.Random(seed)`` (calibration data)."""
    if num_samples > len(examples):
        raise ValueError(f"asked for {num_samples} calibration examples, only {len(examples)} given")
    return random.Random(seed).sample(list(examples), num_samples)


def build_calibration_dataset(tokenizer: Any, examples: Sequence[TextExample]) -> Any:
    """A `datasets.Dataset` of tokenized examples (columns ``input_ids``, ``attention_mask``,
    ``labels``, all rows padded to the same length so `default_data_collator` batches them) —
    FeatCal's `datasets.Dataset` calibration input (shuffled, cut and batched by the config)."""
    from datasets import Dataset

    batch = collate_examples(tokenizer, examples)
    return Dataset.from_dict({k: v.tolist() for k, v in batch.items()})


# --------------------------------------------------------------------------------------------- models
def build_tiny_t5(
    vocab_size: int,
    d_model: int = 64,
    d_ff: int = 128,
    d_kv: int = 16,
    num_heads: int = 4,
    num_layers: int = 2,
    num_decoder_layers: int = 2,
    seed: int = 0,
) -> Any:
    """A random-init `T5ForConditionalGeneration` with FLAN-T5 geometry (gated-GELU feed-forward,
    untied embeddings and LM head), pad = decoder start = 0, eos = 1, no dropout."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_ff=d_ff,
        d_kv=d_kv,
        num_heads=num_heads,
        num_layers=num_layers,
        num_decoder_layers=num_decoder_layers,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(config)
    _untie_lm_head(model, seed)
    return model.eval()


def _untie_lm_head(model: Any, seed: int) -> None:
    """Give `model` its own LM head, as FLAN-T5 checkpoints have.

    transformers 5 forces ``tie_word_embeddings=True`` on every `T5Config` (it keeps the passed value
    only as ``scale_decoder_outputs``) and ties ``lm_head`` to ``shared``; loading a FLAN-T5 checkpoint
    leaves them untied because both tensors are stored with different values. A random-init model
    has to be untied by hand: a fresh N(0, initializer_factor²) head, as T5 initialises untied heads.
    """
    config = model.config
    if model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr():
        generator = torch.Generator().manual_seed(seed + 7919)
        head = torch.randn(model.lm_head.weight.shape, generator=generator) * config.initializer_factor
        model.lm_head.weight = torch.nn.Parameter(head)
    config.tie_word_embeddings = False  # so that a later `tie_weights()` leaves the head alone


def train_seq2seq(
    model: Any,
    tokenizer: Any,
    examples: Sequence[TextExample],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    warmup: int = 20,
    seed: int = 0,
) -> Any:
    """Train `model` in place on `examples` with :func:`train_on_pairs`; returns it in eval mode."""
    pad_id = tokenizer.pad_token_id
    return train_on_pairs(model, _encode(tokenizer, examples), lambda chunk: _collate_ids(chunk, pad_id),
                          steps, batch_size, lr, weight_decay, warmup, seed)


def train_on_pairs(
    model: Any,
    pairs: Sequence[tuple[list[int], list[int]]],
    collate: Callable[[list[tuple[list[int], list[int]]]], dict[str, Tensor]],
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    warmup: int,
    seed: int,
    **forward_kwargs: Any,
) -> Any:
    """The training loop of the text scenarios: AdamW (linear warmup, then linear decay to 0, gradient
    clipping at 1) for `steps` steps, each on `batch_size` random encoded `pairs` made a batch by
    `collate` (the model's loss is ``model(**batch, **forward_kwargs).loss``); returns `model` in eval
    mode. Deterministic for a fixed seed on CPU."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / max(warmup, 1), max(0.0, (steps - s) / max(steps - warmup, 1)))
    )
    model.train()
    for _ in range(steps):
        index = torch.randint(len(pairs), (batch_size,), generator=generator).tolist()
        loss = model(**collate([pairs[i] for i in index]), **forward_kwargs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return model.eval()


# --------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_exact_match(
    model: Any,
    tokenizer: Any,
    test_data: Mapping[str, Sequence[TextExample]],
    batch_size: int = 256,
    max_new_tokens: int = 8,
) -> dict[str, float]:
    """Exact-match accuracy (in %) of greedy generations (``num_beams=1, do_sample=False``) per task
    of `test_data`, plus ``"mean"`` over the tasks. A prediction matches when its decoded text (special
    tokens skipped, whitespace stripped) equals the target text."""
    was_training = model.training
    model.eval()
    scores: dict[str, float] = {}
    for task, examples in test_data.items():
        correct = 0
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            batch = collate_examples(tokenizer, chunk)
            out = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                num_beams=1,
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
            predictions = tokenizer.batch_decode(out, skip_special_tokens=True)
            correct += sum(p.strip() == e.target for p, e in zip(predictions, chunk, strict=True))
        scores[task] = 100.0 * correct / max(len(examples), 1)
    scores["mean"] = sum(scores[t] for t in test_data) / max(len(test_data), 1)
    model.train(was_training)
    return scores


# --------------------------------------------------------------------------------------------- scenario
class ScenarioConfigBase:
    """What the text scenario configs share (dataclasses with ``tasks`` and ``pretrain_tasks``):
    task validation and a JSON-ready dict."""

    tasks: tuple[str, ...]
    pretrain_tasks: tuple[str, ...]

    def __post_init__(self) -> None:
        self.tasks = tuple(self.tasks)
        self.pretrain_tasks = tuple(self.pretrain_tasks)
        unknown = [t for t in self.tasks + self.pretrain_tasks if t not in PRETRAIN_TASKS + TASKS + EXTRA_TASKS]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known: {PRETRAIN_TASKS + TASKS + EXTRA_TASKS}")
        if not self.tasks:
            raise ValueError(f"{type(self).__name__}.tasks must name at least one task")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples as lists)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


@dataclass
class TextScenarioConfig(ScenarioConfigBase):
    """Sizes and training budgets of :func:`build_text_scenario` (defaults: ~30 s on one CPU thread).

    ``pretrain_tasks`` are the base's proxy tasks (full-length inputs). With
    ``pretrain_target_max_length`` = k, the base's pretraining mix also holds the target tasks'
    train examples with at most k digits (None: the base never sees the target tasks and scores 0 on
    them; the merge then collapses to ≈ 5–20 %). Experts train ``expert_steps`` on their full train split.
    """

    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    pretrain_tasks: tuple[str, ...] = PRETRAIN_TASKS
    num_train: int = 2000
    num_test: int = 200
    min_length: int = 3
    max_length: int = 6
    d_model: int = 64
    d_ff: int = 128
    d_kv: int = 16
    num_heads: int = 4
    num_layers: int = 2
    num_decoder_layers: int = 2
    pretrain_target_max_length: int | None = 3
    pretrain_steps: int = 600
    pretrain_lr: float = 3e-3
    expert_steps: int = 300
    expert_lr: float = 1e-3
    batch_size: int = 32
    calibration_samples: int = 64
    calibration_batch_size: int = 16


@dataclass
class ScenarioBase(MergingScenario):
    """What a built text scenario holds.

    ``train_data`` / ``test_data`` map each target task to its examples; ``calibration_batches``
    maps each task to FeatCal batches drawn from its train split; ``pretrain_data`` holds the base's
    pretraining mix per task. ``build_seconds`` is the wall time of building (or loading) it.
    """

    config: Any
    tokenizer: Any
    base: Any
    experts: dict[str, Any]
    train_data: dict[str, list[TextExample]]
    test_data: dict[str, list[TextExample]]
    calibration_batches: dict[str, list[dict[str, Tensor]]]
    pretrain_data: dict[str, list[TextExample]] = field(default_factory=dict)
    build_seconds: float = 0.0

    @property
    def tasks(self) -> tuple[str, ...]:
        """The target tasks (one expert each)."""
        return tuple(self.experts)

    def evaluate(self, model: Any, **kwargs: Any) -> dict[str, float]:
        """Exact match of `model` on the test splits of all target tasks."""
        raise NotImplementedError

    def score_rows(self) -> tuple[dict[str, dict[str, float]], Any]:
        """Exact match of the base, every expert, the experts on their own tasks and the Task
        Arithmetic merge (0.3); also returns that merge."""
        rows: dict[str, dict[str, float]] = {"base": self.evaluate(self.base)}
        for task, expert in self.experts.items():
            rows[f"expert[{task}]"] = self.evaluate(expert)
        rows["experts (own task)"] = {task: rows[f"expert[{task}]"][task] for task in self.tasks}
        rows["experts (own task)"]["mean"] = sum(rows["experts (own task)"].values()) / len(self.tasks)
        merged = self.task_arithmetic(0.3)
        rows["TA 0.3"] = self.evaluate(merged)
        return rows, merged

    def calibrate_with_defaults(self, merged: Any, batches: Mapping[str, list]) -> tuple[Any, Any, float]:
        """`merged` after FeatCal with the default `FeatCalConfig` (base as anchor) on `batches`:
        the calibrated model, its drift report and the seconds it took. The tiny vocabulary leaves
        early-block Grams rank-deficient, so FeatCal's warnings about it are silenced."""
        import warnings

        from hf_featcal import FeatCalCalibrator, FeatCalConfig

        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibrator = FeatCalCalibrator(merged, self.base, self.experts, batches, config=FeatCalConfig(),
                                           show_progress=False)
            calibrated = calibrator.calibrate()
        return calibrated, calibrator.report, time.perf_counter() - start

    def print_scores(self, rows: Mapping[str, Mapping[str, float]]) -> None:
        """Print `rows` as a markdown table: one column per target task, then the mean."""
        columns = list(self.tasks) + ["mean"]
        print("| model | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for name, scores in rows.items():
            print(f"| {name} | " + " | ".join(f"{scores[c]:.1f}" for c in columns) + " |")


@dataclass
class TextScenario(ScenarioBase):
    """Everything of the toy seq2seq merging scenario (see `ScenarioBase`)."""

    config: TextScenarioConfig

    def calibration_datasets(self) -> dict[str, Any]:
        """Per task, a `datasets.Dataset` of the same examples as ``calibration_batches``."""
        out = {}
        for task, batches in self.calibration_batches.items():
            from datasets import Dataset

            rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
            width = {k: max(b[k].shape[1] for b in batches) for k in rows}
            fills = {"input_ids": self.tokenizer.pad_token_id, "attention_mask": 0, "labels": -100}
            for b in batches:
                for k, column in rows.items():
                    value = b[k]
                    padded = torch.full((value.shape[0], width[k]), fills[k], dtype=value.dtype)
                    padded[:, : value.shape[1]] = value
                    column.extend(padded.tolist())
            out[task] = Dataset.from_dict(rows)
        return out

    def evaluate(self, model: Any, **kwargs: Any) -> dict[str, float]:
        """:func:`evaluate_exact_match` of `model` on the test splits of all target tasks."""
        return evaluate_exact_match(model, self.tokenizer, self.test_data, **kwargs)


def scenario_splits(config: Any) -> tuple[dict[str, list[TextExample]], dict[str, list[TextExample]],
                                          dict[str, list[TextExample]]]:
    """Per target task deterministic train/test examples, and the base's pretraining mix: the proxy
    tasks plus, when ``config.pretrain_target_max_length`` is set, the target tasks' short TRAIN
    examples. `config` has the fields of :class:`TextScenarioConfig` that describe data."""
    seed = config.seed
    train_data: dict[str, list[TextExample]] = {}
    test_data: dict[str, list[TextExample]] = {}
    for task in config.tasks:
        train_data[task], test_data[task] = generate_task_examples(
            task, config.num_train, config.num_test, seed, config.min_length, config.max_length
        )
    pretrain_data = {
        task: generate_task_examples(task, config.num_train, 0, seed, config.min_length, config.max_length)[0]
        for task in config.pretrain_tasks
    }
    if config.pretrain_target_max_length is not None:
        for task in config.tasks:
            if task not in pretrain_data:
                pretrain_data[task] = [
                    e for e in train_data[task] if len(e.source.split()) - 1 <= config.pretrain_target_max_length
                ]
    return train_data, test_data, pretrain_data


def pretrain_and_finetune(
    base: Any,
    tokenizer: Any,
    train: Callable[..., Any],
    pretrain_data: Mapping[str, Sequence[TextExample]],
    train_data: Mapping[str, Sequence[TextExample]],
    config: Any,
) -> dict[str, Any]:
    """Pretrain `base` (in place) on the mix of `pretrain_data`, then make one expert per task: a copy
    of the base fine-tuned on that task's train split. `train(model, tokenizer, examples, steps,
    batch_size, lr, seed=...)` is the family's training loop."""
    mix = [e for examples in pretrain_data.values() for e in examples]
    if config.pretrain_steps > 0 and mix:
        train(base, tokenizer, mix, config.pretrain_steps, config.batch_size, config.pretrain_lr, seed=config.seed)
    experts = {}
    for index, task in enumerate(config.tasks):
        expert = copy.deepcopy(base)
        train(expert, tokenizer, train_data[task], config.expert_steps, config.batch_size, config.expert_lr,
              seed=config.seed * 1000 + index + 1)
        experts[task] = expert
    return experts


def resolve_config(config: Any, default: Callable[[], Any], seed: int | None) -> Any:
    """A copy of `config` (or ``default()``) with ``seed`` set when one is given."""
    config = copy.deepcopy(config) if config is not None else default()
    if seed is not None:
        config.seed = seed
    return config


def save_scenario_build(path: str, key: Mapping[str, Any], tokenizer: Any, base: Any,
                        experts: Mapping[str, Any]) -> None:
    """`save_build` of a text scenario: ``base/``, ``expert_<task>/`` and ``tokenizer/``."""
    models = {"base": base, **{f"expert_{task}": expert for task, expert in experts.items()}}
    save_build(path, key, models, lambda folder: tokenizer.save_pretrained(os.path.join(folder, "tokenizer")))


def build_or_load_models(
    cache_dir: str | os.PathLike | None,
    folder: str,
    key: Mapping[str, Any],
    config: Any,
    tokenizer: Any,
    new_base: Callable[[], Any],
    train: Callable[..., Any],
    load: Callable[[str], Any],
    pretrain_data: Mapping[str, Sequence[TextExample]],
    train_data: Mapping[str, Sequence[TextExample]],
) -> tuple[Any, dict[str, Any]]:
    """The base and experts of a text scenario: loaded from ``cache_dir/folder`` when it holds a build
    made with `key`, else built (``new_base()``, then :func:`pretrain_and_finetune` with `train`) and,
    with a `cache_dir`, saved there (replacing a build with another key; data are never cached: they are
    cheap and deterministic). `load(model_folder)` reads one saved model."""
    path = None if cache_dir is None else os.path.join(os.fspath(cache_dir), folder)

    def build() -> tuple[Any, dict[str, Any]]:
        base = new_base()
        return base, pretrain_and_finetune(base, tokenizer, train, pretrain_data, train_data, config)

    def load_all(root: str) -> tuple[Any, dict[str, Any]]:
        experts = load_models(load, root, {"base": "base", **{task: f"expert_{task}" for task in config.tasks}})
        return experts.pop("base"), experts  # "base" is not a task name (checked by the config)

    (base, experts), _ = build_or_load(
        path, key, build, lambda root, models: save_scenario_build(root, key, tokenizer, *models), load_all
    )
    return base, experts


def build_text_scenario(
    seed: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    config: TextScenarioConfig | None = None,
) -> TextScenario:
    """Build (or load from `cache_dir`) the toy seq2seq merging scenario.

    Steps: the tokenizer; per task deterministic train/test splits; a random-init tiny T5 base
    pretrained for ``pretrain_steps`` on the proxy tasks (:data:`PRETRAIN_TASKS`) plus, with
    ``pretrain_target_max_length``, the short train examples of the target tasks; one expert per task
    (a copy of the base fine-tuned for ``expert_steps``); FeatCal calibration batches from the train
    splits. With `cache_dir`, the tokenizer and models are saved there (``save_pretrained``: ``base/``,
    ``expert_<task>/``, ``tokenizer/`` in ``text-scenario/``) and the models are reloaded on later calls with the
    same config and vocabulary (else rebuilt and overwritten); data are always regenerated (cheap, deterministic).
    `seed`, when given, overrides ``config.seed`` (default 0).
    """
    start = time.perf_counter()
    config = resolve_config(config, TextScenarioConfig, seed)
    seed = config.seed
    tokenizer = build_text_tokenizer()
    train_data, test_data, pretrain_data = scenario_splits(config)

    def new_base() -> Any:
        return build_tiny_t5(
            len(tokenizer),
            d_model=config.d_model,
            d_ff=config.d_ff,
            d_kv=config.d_kv,
            num_heads=config.num_heads,
            num_layers=config.num_layers,
            num_decoder_layers=config.num_decoder_layers,
            seed=seed,
        )

    base, experts = build_or_load_models(cache_dir, "text-scenario", _cache_key(config), config, tokenizer, new_base,
                                         train_seq2seq, _load_t5, pretrain_data, train_data)
    calibration = {
        task: build_calibration_batches(
            tokenizer, train_data[task], config.calibration_samples, config.calibration_batch_size, seed=seed
        )
        for task in config.tasks
    }
    return TextScenario(
        config=config,
        tokenizer=tokenizer,
        base=base,
        experts=experts,
        train_data=train_data,
        test_data=test_data,
        calibration_batches=calibration,
        pretrain_data=pretrain_data,
        build_seconds=time.perf_counter() - start,
    )


def _cache_key(config: TextScenarioConfig) -> dict[str, Any]:
    """What a cached build depends on: the config and the vocabulary."""
    return {"format": _CACHE_FORMAT, "config": config.to_dict(), "vocabulary": list(VOCABULARY)}


def _load_t5(folder: str) -> Any:
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(folder)
    # a separate head with different values is stored, so transformers left it untied (see
    # `_untie_lm_head`) but set the config flag back to True
    if model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr():
        model.config.tie_word_embeddings = False
    return model


# --------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``cd tests && python -m scenarios.text [--seed N] [--cache-dir DIR]``: build the scenario and print the
    exact match of the base, each expert, the Task Arithmetic merge (0.3) and the merge after FeatCal
    (default `FeatCalConfig`, base as anchor); returns the table."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    scenario = build_text_scenario(seed=args.seed, cache_dir=args.cache_dir)
    print(f"built in {scenario.build_seconds:.1f} s (seed {args.seed})")
    rows, merged = scenario.score_rows()
    calibrated, report, seconds = scenario.calibrate_with_defaults(merged, scenario.calibration_batches)
    print(f"FeatCal in {seconds:.1f} s")
    rows["TA 0.3 + FeatCal"] = scenario.evaluate(calibrated)
    scenario.print_scores(rows)
    if report is not None:
        print(report.summary_markdown())
    return rows


if __name__ == "__main__":  # pragma: no cover
    main()
