"""A MergeBench-style LLM merge, calibrated with FeatCal (needs the hub and a GPU for real sizes).

base `meta-llama/Llama-3.2-3B`, experts `MergeBench/Llama-3.2-3B_<task>` (instruction, math,
multilingual, coding, safety — the public MergeBench checkpoints), Task Arithmetic, then FeatCal on a
few hundred instruction-style examples per task with only the response tokens counted. Experts are
read from the hub block by block; the merged model is saved for evaluation with the tool of your
choice (see docs/llm.md for lm-evaluation-harness).

    python examples/mergebench_llama.py --output llama32-3b-mergebench-featcal \\
        --data math=openai/gsm8k:main:train:question:answer --data coding=...

Published (arXiv 2605.13030, MergeBench): Llama-3.2-3B Task Arithmetic 60.1 → FeatCal 62.1.

Calibration data: MergeBench's own training sets are not bundled here. `--data TASK=ID:CONFIG:SPLIT:PROMPT:RESPONSE`
names a hub dataset and its prompt / response columns (CONFIG may be empty); the defaults below are
public datasets of the same kind chosen by us, not MergeBench's — replace them with your own.
"""

from __future__ import annotations

import argparse

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.merging import task_arithmetic

BASE = "meta-llama/Llama-3.2-3B"
TASKS = ["instruction", "math", "multilingual", "coding", "safety"]
DEFAULT_DATA = {
    "instruction": "tatsu-lab/alpaca::train:instruction:output",
    "math": "openai/gsm8k:main:train:question:answer",
    "multilingual": "CohereForAI/aya_dataset::train:inputs:targets",
    "coding": "google-research-datasets/mbpp:full:train:text:code",
}


def calibration_batches(tokenizer, spec: str, count: int, length: int, batch_size: int, seed: int) -> list[dict]:
    """Prompt + response sequences; `labels` are -100 on the prompt and padding, so that FeatCal
    counts only the positions of the response."""
    dataset_id, config, split, prompt_col, response_col = spec.split(":")
    data = load_dataset(dataset_id, config or None, split=split).shuffle(seed=seed).select(range(count))
    rows = []
    for example in data:
        prompt = tokenizer(str(example[prompt_col]) + "\n", add_special_tokens=True)["input_ids"]
        response = tokenizer(str(example[response_col]) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt + response)[:length]
        labels = ([-100] * len(prompt) + response)[:length]
        rows.append((ids, labels))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        batches.append({
            "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in chunk]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chunk]),
        })
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--data", action="append", default=[], metavar="TASK=ID:CONFIG:SPLIT:PROMPT:RESPONSE")
    parser.add_argument("--samples-per-task", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--scaling-factor", type=float, default=0.3)
    parser.add_argument("--output", default="llama32-3b-mergebench-featcal")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None)
    args = parser.parse_args()

    data_specs = {**DEFAULT_DATA, **dict(item.split("=", 1) for item in args.data)}
    missing = [t for t in args.tasks if t not in data_specs]
    if missing:
        parser.error(f"no calibration data for tasks {missing}: pass --data TASK=ID:CONFIG:SPLIT:PROMPT:RESPONSE")

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.bfloat16)
    experts = {task: f"MergeBench/Llama-3.2-3B_{task}" for task in args.tasks}  # read lazily
    merged = task_arithmetic(base, experts, scaling_factor=args.scaling_factor)
    calibration = {
        task: calibration_batches(tokenizer, data_specs[task], args.samples_per_task, args.max_length, 8, seed=42)
        for task in args.tasks
    }
    calibrator = FeatCalCalibrator(merged, BASE, experts, calibration,
                                   FeatCalConfig(num_samples_per_task=args.samples_per_task))
    calibrator.calibrate()
    print(calibrator.report.summary_markdown())
    calibrator.save_model(args.output)
    tokenizer.save_pretrained(args.output)
    if args.push_to_hub:
        calibrator.push_to_hub(args.push_to_hub)


if __name__ == "__main__":
    main()
