"""What a run holds at once: a stream is held twice for one task at a time while a block's outputs
replace its inputs, and the calibration batches are let go once the streams have entered the last stack
(for a one-stack tower: each task's as soon as its streams have entered, while the calibrator is built;
an LLM, whose plan reads every task's batches, and T5's two stacks keep them until `calibrate()`)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from hf_featcal.pipeline.context import RunContext
from testing_utils import build_clip_setting, perturbed, task_arithmetic

BATCH_SIZES = (5, 5, 3)


def test_a_block_replaces_its_streams_one_task_at_a_time(generator, monkeypatch):
    """The most stream batches alive at once (counted at every `park`, where each new one is made):
    the student and expert streams of every task, plus one new batch made while its entering one is
    alive (each entering batch goes once it has been through the block)."""
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    alive: list[weakref.ref] = []
    most = [0]
    park = RunContext.park

    def counting_park(self, state):
        parked = park(self, state)
        alive.append(weakref.ref(parked.hidden))
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        return parked

    monkeypatch.setattr(RunContext, "park", counting_park)
    calibrator = FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(report_drift=False), show_progress=False)
    calibrator.calibrate()
    per_task = len(BATCH_SIZES)
    # two streams of every task, and one batch made while its entering one is alive (a task's batches
    # made while all its entering ones are alive would be 12 + 3; the whole stream twice, 2 · 2 · 2 · 3 = 24)
    assert most[0] == 2 * len(experts) * per_task + 1


def test_calibration_batches_let_go_and_a_stopped_run_refuses_a_second_try(generator, monkeypatch):
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    given = {task: list(batches) for task, batches in data.items()}
    calibrator = FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, show_progress=False)
    # one stack: every task's streams entered it while the calibrator was built, and its batches went
    assert calibrator.batches == {"cars": [], "dtd": []}
    assert calibrator.batch_sizes == {"cars": [5, 5, 3], "dtd": [5, 5, 3]}
    assert all(data[task] == given[task] for task in data)  # the caller's own lists are untouched

    def fail(*args, **kwargs):
        raise RuntimeError("fault injected")

    monkeypatch.setattr(calibrator, "_solve_and_write", fail)
    with pytest.raises(RuntimeError, match="fault injected"):
        calibrator.calibrate()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="build a new FeatCalCalibrator"):
        calibrator.calibrate()
    FeatCalCalibrator(copy.deepcopy(merged), base, experts, data, show_progress=False).calibrate()


def test_a_refused_config_change_leaves_the_entered_streams_for_a_second_try(generator):
    """A `calibrate()` refused before any block ran keeps what entered while the calibrator was built."""
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    calibrator = FeatCalCalibrator(merged, base, experts, data, show_progress=False)
    calibrator.config.batch_size = 2
    with pytest.raises(ValueError, match="batch_size changed"):
        calibrator.calibrate()
    calibrator.config.batch_size = FeatCalConfig().batch_size
    calibrator.calibrate()
    for (name, p), q in zip(merged.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


class _MadeWhenRead:
    """A task's batches made as they are read (as a data loader makes them), each image tensor
    watched through a weak reference."""

    def __init__(self, batches, watched, before_first=None, key="pixel_values"):
        self.batches, self.watched, self.before_first, self.key = batches, watched, before_first, key

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            if index == 0 and self.before_first is not None:
                self.before_first()
            made = {key: value.clone() for key, value in batch.items()}
            self.watched.append(weakref.ref(made[self.key]))
            yield made


def test_no_task_inputs_outlive_its_entry_into_a_one_stack_tower(generator):
    """The images of one task are let go before the next task's are read: the calibrator never holds
    every task's inputs at once (at the paper's 8 × 256 images, 1.15 GiB)."""
    base, experts, merged, data = build_clip_setting(generator, BATCH_SIZES)
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    watched = {task: [] for task in data}
    alive_when_next_read: list[int] = []

    def count_first_task_images():
        gc.collect()
        alive_when_next_read.append(sum(ref() is not None for ref in watched["cars"]))

    streams = {"cars": _MadeWhenRead(data["cars"], watched["cars"]),
               "dtd": _MadeWhenRead(data["dtd"], watched["dtd"], before_first=count_first_task_images)}
    calibrator = FeatCalCalibrator(merged, base, experts, streams, show_progress=False)
    gc.collect()
    assert alive_when_next_read == [0]  # "cars"'s images were gone before "dtd"'s were read
    assert len(watched["cars"]) == len(watched["dtd"]) == 3
    assert all(ref() is None for refs in watched.values() for ref in refs)
    calibrator.calibrate()
    for (name, p), q in zip(merged.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name  # the same calibration as from batches held by the caller


def _llama_setting(generator):
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0,
                         tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("math", "code")}
    data = {t: [{"input_ids": torch.randint(1, 32, (3, 6), generator=generator),
                 "attention_mask": torch.ones(3, 6, dtype=torch.long)} for _ in range(2)] for t in experts}
    return base, experts, task_arithmetic(base, experts), data


def _t5_setting(generator):
    config = T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    base = T5ForConditionalGeneration(config).eval()
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("cola", "sst2")}
    data = {t: [{"input_ids": torch.randint(1, 32, (3, 6), generator=generator),
                 "attention_mask": torch.ones(3, 6, dtype=torch.long),
                 "labels": torch.randint(1, 32, (3, 2), generator=generator)} for _ in range(2)] for t in experts}
    return base, experts, task_arithmetic(base, experts), data


@pytest.mark.parametrize("setting", [_llama_setting, _t5_setting], ids=["llama_plan_from_batches", "t5_two_stacks"])
def test_towers_that_need_every_task_s_batches_keep_them_until_calibrate(generator, setting):
    """A tower whose plan reads every task's batches (an LLM's response tokens) or that has two stacks (T5's
    encoder and decoder) keeps each task's batches until `calibrate()`, as before the one-stack towers took
    theirs in as they were read; the calibration is the same as from batches the caller holds."""
    base, experts, merged, data = setting(generator)
    reference = copy.deepcopy(merged)
    FeatCalCalibrator(reference, base, experts, data, show_progress=False).calibrate()
    made_when_read = {task: _MadeWhenRead(batches, [], key="input_ids") for task, batches in data.items()}
    calibrator = FeatCalCalibrator(merged, base, experts, made_when_read, show_progress=False)
    for task, batches in data.items():
        kept = calibrator.batches[task]
        assert len(kept) == len(batches) and len(made_when_read[task].watched) == len(batches)
        for given, held in zip(batches, kept, strict=True):
            assert torch.equal(held["input_ids"], given["input_ids"])
    calibrator.calibrate()
    for (name, p), q in zip(merged.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
