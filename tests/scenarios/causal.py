"""A small, offline multi-task scenario for decoder-only LLMs (a tiny Llama), for tests and benchmarks.

The causal-LM counterpart of :mod:`scenarios.text`: the same digit-list tasks and vocabulary,
written as prompt-then-answer text, ``"sort: 3 1 4 = 1 3 4 </s>"``, for a random-init
`LlamaForCausalLM`: a "pretrained" base that knows the prompt format and partly solves the tasks,
one fully fine-tuned expert per task, their Task Arithmetic merge, exact match of greedy
generations. Everything is built offline from a seed, in about 30 s on one CPU thread.

- **Tokenizer** (:func:`build_causal_tokenizer`): :data:`scenarios.text.VOCABULARY` (same ids:
  ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, task prefixes, digits, label words) plus the separator ``=``
  (last id, 37 words in all); a `tokenizers` WordLevel model with a whitespace pre-tokenizer. Unlike
  the T5 tokenizer it appends nothing (the answer carries its ``</s>``).
- **Examples**: :func:`scenarios.text.generate_task_examples` (``source`` "sort: 3 1 4",
  ``target`` "1 3 4"; tasks ``sort``, ``min``, ``max``, ``count`` over 3–6 digits); the prompt is
  ``source + " ="``, the answer ``target + " </s>"``.
- **Models**: a random-init `LlamaForCausalLM` (hidden 64, 3 layers, 4 heads, 2 key/value heads,
  SwiGLU 128, untied LM head, ~116k parameters). The base is pretrained (1200 steps) on the proxy
  tasks ``copy`` and ``shift`` (3–6 digits) plus the target tasks on short inputs only (≤ 4 digits,
  from their train splits); each expert is the base fully fine-tuned on one task (300 steps, AdamW
  5e-4). The loss counts the answer tokens only (``labels`` = -100 on the prompt and padding).
- **Evaluation** (:func:`evaluate_causal_exact_match`): greedy ``generate`` after the prompt (prompts
  of one length batched together, so no batch needs padding); the answer is the text before the
  first ``</s>``; exact match per task on the test split (200 examples) and their mean.
- **Calibration batches** (:func:`build_causal_calibration_batches`), 64 examples per task drawn from
  the TRAIN splits in batches of 16: ``input_ids``, ``attention_mask`` and ``labels`` (right padding;
  -100 on the prompt and padding). FeatCal's Llama layer map counts the positions where
  ``labels != -100``. At position t a causal LM's features predict token t + 1, so there are two
  choices of counted positions (``CausalScenarioConfig.calibration_positions``):

  * ``"predicting"`` (the default): the positions whose features *predict* the answer tokens — the
    ``=`` (it predicts the first answer token, i.e. the whole answer of ``min``/``max``/``count``)
    through the last answer token before ``</s>``. These ``labels`` are stored pre-shifted:
    ``labels[t]`` is the token position t predicts (``input_ids[t + 1]``). They are a calibration
    mask, not Hugging Face training labels (a model's own loss would shift them a second time).
  * ``"answer"``: the answer tokens themselves, ``</s>`` included — standard causal-LM labels
    (``labels[t] = input_ids[t]`` on the answer), as a Hugging Face SFT dataset carries them. This
    leaves out the ``=`` position and counts the ``</s>`` position, whose prediction is never used.

  The default is the choice that matches what is scored (the features that produce the answer);
  it lowered the last-block drift of every task on every seed tried. Measured (seeds 0–5, default
  `FeatCalConfig`, base as anchor): ``"answer"`` gives the larger mean exact-match gain on this
  scenario, but not a lower drift everywhere (see the table).

Scores (exact match in %, mean over the 4 tasks; experts on their own task):

====  ====  =======  ======  ======================  =====================
seed  base  experts  TA 0.3  + FeatCal (predicting)  + FeatCal (answer)
====  ====  =======  ======  ======================  =====================
0     72.0  98.2     71.0    81.9                    78.6 (count drift up)
1     65.2  98.8     67.6    81.8                    83.9
2     64.5  99.4     64.9    69.8                    73.1
3     68.2  98.9     70.0    75.6                    90.2
4     69.9  97.0     71.6    77.1                    82.6 (max drift up)
5     58.6  98.1     69.5    74.5                    73.0
mean  66.4  98.4     69.1    76.8                    80.2
====  ====  =======  ======  ======================  =====================

The merge lands near the base (``min``/``max`` ≈ 93–100 %, ``sort`` ≈ 29–47 %, ``count`` ≈ 40–48 %),
about 30 points below the experts. FeatCal (``"predicting"``) gains on every seed, from ``sort``
(+3 to +17 points) and ``count`` (+1 to +37; seed 0: 45.5 → 81.0), with ``min``/``max`` staying at
≈ 93–100 %; on seed 2 the gain is only +4.9. Counting every non-padding token (batches without
``labels``) gave 77.9 on average.

Use :func:`build_causal_scenario`; ``cd tests && python -m scenarios.causal [--positions both]`` prints
the score table and drift.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from scenarios.text import (
    EOS_TOKEN,
    PAD_TOKEN,
    PRETRAIN_TASKS,
    TASKS,
    UNK_TOKEN,
    VOCABULARY,
    ScenarioBase,
    ScenarioConfigBase,
    TextExample,
    build_or_load_models,
    resolve_config,
    sample_examples,
    scenario_splits,
    train_on_pairs,
)

__all__ = [
    "CALIBRATION_POSITIONS",
    "CAUSAL_VOCABULARY",
    "SEPARATOR",
    "CausalScenario",
    "CausalScenarioConfig",
    "build_causal_calibration_batches",
    "build_causal_scenario",
    "build_causal_tokenizer",
    "build_tiny_llama",
    "collate_causal",
    "encode_causal",
    "evaluate_causal_exact_match",
    "prompt_text",
    "train_causal_lm",
]

#: Between prompt and answer.
SEPARATOR = "="
#: The toy vocabulary of :mod:`scenarios.text` (same ids) plus the separator.
CAUSAL_VOCABULARY: tuple[str, ...] = VOCABULARY + (SEPARATOR,)
#: What ``labels != -100`` marks in calibration batches (see the module docstring).
CALIBRATION_POSITIONS: tuple[str, ...] = ("predicting", "answer")

_CACHE_FORMAT = 1  # bump when a change to this module changes what a build produces


# --------------------------------------------------------------------------------------------- tokenizer
def build_causal_tokenizer() -> Any:
    """The offline word-level tokenizer (a `transformers.PreTrainedTokenizerFast`) over
    :data:`CAUSAL_VOCABULARY`: ``<pad>`` 0, ``</s>`` 1 (eos), ``<unk>`` 2, ..., ``=`` last. It adds no
    special tokens (prompts end with ``=``, answers carry their ``</s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(CAUSAL_VOCABULARY)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=64,
        padding_side="right",
    )


# --------------------------------------------------------------------------------------------- data
def prompt_text(example: TextExample) -> str:
    """``"sort: 3 1 4 ="``."""
    return f"{example.source} {SEPARATOR}"


def encode_causal(tokenizer: Any, examples: Sequence[TextExample]) -> list[tuple[list[int], list[int]]]:
    """Per example ``(prompt_ids, answer_ids)``: the prompt through ``=``, the answer with ``</s>``."""
    prompts = tokenizer([prompt_text(e) for e in examples], add_special_tokens=False)["input_ids"]
    answers = tokenizer([e.target for e in examples], add_special_tokens=False)["input_ids"]
    return [(p, a + [tokenizer.eos_token_id]) for p, a in zip(prompts, answers, strict=True)]


def collate_causal(
    pairs: Sequence[tuple[list[int], list[int]]],
    pad_id: int,
    positions: str = "answer",
) -> dict[str, Tensor]:
    """A right-padded batch ``{input_ids, attention_mask, labels}`` of prompt+answer sequences.

    ``positions="answer"``: standard causal-LM labels (``labels[t] = input_ids[t]`` on the answer
    tokens, -100 on the prompt and padding; the model shifts them for its loss).
    ``positions="predicting"``: pre-shifted, ``labels[t] = input_ids[t + 1]`` on the positions that
    predict an answer token (the ``=`` through the last token before ``</s>``), -100 elsewhere — a
    calibration mask, not training labels.
    """
    if positions not in CALIBRATION_POSITIONS:
        raise ValueError(f"positions must be one of {CALIBRATION_POSITIONS}, got {positions!r}")
    width = max(len(p) + len(a) for p, a in pairs)
    input_ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for row, (prompt, answer) in enumerate(pairs):
        ids = torch.tensor(prompt + answer)
        n, start = len(ids), len(prompt)
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        if positions == "answer":
            labels[row, start:n] = ids[start:]
        else:
            labels[row, start - 1 : n - 1] = ids[start:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_causal_calibration_batches(
    tokenizer: Any,
    examples: Sequence[TextExample],
    num_samples: int = 64,
    batch_size: int = 16,
    seed: int = 0,
    positions: str = "predicting",
) -> list[dict[str, Tensor]]:
    """FeatCal calibration batches of one task: `num_samples` examples drawn (without replacement,
    seeded) from `examples` — pass the TRAIN split — in batches of `batch_size`; `positions` picks
    the counted positions (:func:`collate_causal`)."""
    pairs = encode_causal(tokenizer, sample_examples(examples, num_samples, seed))
    return [
        collate_causal(pairs[i : i + batch_size], tokenizer.pad_token_id, positions)
        for i in range(0, num_samples, batch_size)
    ]


# --------------------------------------------------------------------------------------------- models
def build_tiny_llama(
    vocab_size: int,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    seed: int = 0,
) -> Any:
    """A random-init `LlamaForCausalLM` (untied LM head, no dropout), pad 0, eos 1, no bos."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def train_causal_lm(
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
    """Train `model` in place as a causal LM on `examples` (loss on the answer tokens only) with
    :func:`scenarios.text.train_on_pairs`; returns it in eval mode."""
    pad_id = tokenizer.pad_token_id
    return train_on_pairs(model, encode_causal(tokenizer, examples),
                          lambda chunk: collate_causal(chunk, pad_id, "answer"),
                          steps, batch_size, lr, weight_decay, warmup, seed, use_cache=False)


# --------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_causal_exact_match(
    model: Any,
    tokenizer: Any,
    test_data: Mapping[str, Sequence[TextExample]],
    batch_size: int = 256,
    max_new_tokens: int = 8,
) -> dict[str, float]:
    """Exact-match accuracy (in %) of greedy generations after each prompt, per task of `test_data`,
    plus ``"mean"`` over the tasks. The prediction is the generated text before the first ``</s>``
    (all of it when there is none); it matches when it equals the target text. Prompts of one length
    are generated together, so no batch needs padding."""
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    scores: dict[str, float] = {}
    for task, examples in test_data.items():
        groups: dict[int, list[int]] = defaultdict(list)
        encoded = encode_causal(tokenizer, examples)
        for i, (prompt, _) in enumerate(encoded):
            groups[len(prompt)].append(i)
        correct = 0
        for length in sorted(groups):
            indices = groups[length]
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                input_ids = torch.tensor([encoded[i][0] for i in chunk], dtype=torch.long)
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    num_beams=1,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=eos,
                )
                for i, row in zip(chunk, out[:, length:].tolist(), strict=True):
                    answer = row[: row.index(eos)] if eos in row else row
                    correct += tokenizer.decode(answer).strip() == examples[i].target
        scores[task] = 100.0 * correct / max(len(examples), 1)
    scores["mean"] = sum(scores[t] for t in test_data) / max(len(test_data), 1)
    model.train(was_training)
    return scores


# --------------------------------------------------------------------------------------------- scenario
@dataclass
class CausalScenarioConfig(ScenarioConfigBase):
    """Sizes and training budgets of :func:`build_causal_scenario`.

    ``pretrain_tasks`` are the base's proxy tasks (full-length inputs); with
    ``pretrain_target_max_length`` = k the base's pretraining mix also holds the target tasks' train
    examples with at most k digits. Experts train ``expert_steps`` on their full train split.
    ``calibration_positions`` picks the positions FeatCal counts (see the module docstring).
    """

    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    pretrain_tasks: tuple[str, ...] = PRETRAIN_TASKS
    num_train: int = 2000
    num_test: int = 200
    min_length: int = 3
    max_length: int = 6
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    pretrain_target_max_length: int | None = 4
    pretrain_steps: int = 1200
    pretrain_lr: float = 3e-3
    expert_steps: int = 300
    expert_lr: float = 5e-4
    batch_size: int = 32
    calibration_samples: int = 64
    calibration_batch_size: int = 16
    calibration_positions: str = "predicting"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.calibration_positions not in CALIBRATION_POSITIONS:
            raise ValueError(
                f"CausalScenarioConfig.calibration_positions must be one of {CALIBRATION_POSITIONS}, "
                f"got {self.calibration_positions!r}"
            )

@dataclass
class CausalScenario(ScenarioBase):
    """Everything of the toy causal-LM merging scenario (see `ScenarioBase`)."""

    config: CausalScenarioConfig

    def calibration_data(
        self, positions: str | None = None, num_samples: int | None = None
    ) -> dict[str, list[dict[str, Tensor]]]:
        """Calibration batches per task, drawn as ``calibration_batches`` were, with other counted
        `positions` (``"predicting"`` / ``"answer"``) or another `num_samples`."""
        cfg = self.config
        return {
            task: build_causal_calibration_batches(
                self.tokenizer,
                self.train_data[task],
                num_samples if num_samples is not None else cfg.calibration_samples,
                cfg.calibration_batch_size,
                seed=cfg.seed,
                positions=positions if positions is not None else cfg.calibration_positions,
            )
            for task in self.tasks
        }

    def evaluate(self, model: Any, **kwargs: Any) -> dict[str, float]:
        """:func:`evaluate_causal_exact_match` of `model` on the test splits of all target tasks."""
        return evaluate_causal_exact_match(model, self.tokenizer, self.test_data, **kwargs)


def build_causal_scenario(
    seed: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    config: CausalScenarioConfig | None = None,
) -> CausalScenario:
    """Build (or load from `cache_dir`) the toy causal-LM merging scenario.

    Steps: the tokenizer; per task deterministic train/test splits (the generator of
    :mod:`scenarios.text`); a random-init tiny Llama base pretrained for ``pretrain_steps`` on
    the proxy tasks plus the short train examples of the target tasks; one expert per task (a copy of
    the base fine-tuned for ``expert_steps``); FeatCal calibration batches from the train splits.
    With `cache_dir`, the models and tokenizer are saved in ``causal-scenario/`` there and reloaded by
    later calls with the same config (else rebuilt and overwritten); data are always regenerated.
    `seed`, when given, overrides ``config.seed`` (default 0).
    """
    from transformers import LlamaForCausalLM

    start = time.perf_counter()
    config = resolve_config(config, CausalScenarioConfig, seed)
    seed = config.seed
    tokenizer = build_causal_tokenizer()
    train_data, test_data, pretrain_data = scenario_splits(config)

    def new_base() -> Any:
        return build_tiny_llama(
            len(tokenizer),
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            seed=seed,
        )

    base, experts = build_or_load_models(cache_dir, "causal-scenario", _cache_key(config), config, tokenizer, new_base,
                                         train_causal_lm, LlamaForCausalLM.from_pretrained, pretrain_data, train_data)
    scenario = CausalScenario(
        config=config,
        tokenizer=tokenizer,
        base=base,
        experts=experts,
        train_data=train_data,
        test_data=test_data,
        calibration_batches={},
        pretrain_data=pretrain_data,
    )
    scenario.calibration_batches = scenario.calibration_data()
    scenario.build_seconds = time.perf_counter() - start
    return scenario


def _cache_key(config: CausalScenarioConfig) -> dict[str, Any]:
    """What a cached build depends on: the config (minus what only shapes calibration data) and the
    vocabulary."""
    settings = config.to_dict()
    for name in ("calibration_samples", "calibration_batch_size", "calibration_positions"):
        settings.pop(name)
    return {"format": _CACHE_FORMAT, "config": settings, "vocabulary": list(CAUSAL_VOCABULARY)}


# --------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``cd tests && python -m scenarios.causal [--seed N] [--cache-dir DIR] [--positions predicting|answer|both]``:
    build the scenario and print the exact match of the base, each expert, the Task Arithmetic merge
    (0.3) and the merge after FeatCal (default `FeatCalConfig`, base as anchor); returns the table."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--positions", default="predicting", choices=CALIBRATION_POSITIONS + ("both",))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    scenario = build_causal_scenario(seed=args.seed, cache_dir=args.cache_dir)
    print(f"built in {scenario.build_seconds:.1f} s (seed {args.seed})")
    rows, merged = scenario.score_rows()
    reports = {}
    for positions in CALIBRATION_POSITIONS if args.positions == "both" else (args.positions,):
        calibrated, reports[positions], seconds = scenario.calibrate_with_defaults(merged,
                                                                                   scenario.calibration_data(positions))
        print(f"FeatCal ({positions} positions) in {seconds:.1f} s")
        rows[f"TA 0.3 + FeatCal ({positions})"] = scenario.evaluate(calibrated)
    scenario.print_scores(rows)
    for positions, report in reports.items():
        if report is not None:
            print(f"\ndrift ({positions} positions)\n" + report.summary_markdown())
    return rows


if __name__ == "__main__":  # pragma: no cover
    main()
