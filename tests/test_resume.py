"""checkpoint_dir: an interrupted run continues from the last finished block and gives the
uninterrupted result; a checkpoint of another run is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import T5ForConditionalGeneration

from hf_featcal import FeatCalCalibrator, FeatCalConfig
from test_t5 import randomise_t5_norms, seq2seq_batch, t5_config
from testing_utils import perturbed, task_arithmetic


def _run(merged, base, experts, data, checkpoint_dir=None, config=None, interrupt_at=None, monkeypatch=None):
    model = copy.deepcopy(merged)
    calibrator = FeatCalCalibrator(model, base, experts, data, config or FeatCalConfig(), show_progress=False,
                                   checkpoint_dir=checkpoint_dir)
    calls = []
    original = calibrator._calibrate_block

    def counting(plan, *args):
        calls.append((plan.stack_index, plan.block_index))
        if interrupt_at is not None and len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return original(plan, *args)

    monkeypatch.setattr(calibrator, "_calibrate_block", counting)
    calibrator.calibrate()
    return model, calibrator, calls


def _interrupt_then_resume(merged, base, experts, data, tmp_path, monkeypatch, interrupt_at, total):
    expected, reference, _ = _run(merged, base, experts, data, monkeypatch=monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _run(merged, base, experts, data, tmp_path, interrupt_at=interrupt_at, monkeypatch=monkeypatch)
    resumed, calibrator, calls = _run(merged, base, experts, data, tmp_path, monkeypatch=monkeypatch)
    assert len(calls) == total - (interrupt_at - 1)  # finished blocks were not redone
    for (name, p), q in zip(resumed.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert calibrator.report.to_dict() == reference.report.to_dict()
    assert len(calibrator.solve_log) == len(reference.solve_log)
    # a finished checkpoint: nothing left to do, same model again
    again, _, calls = _run(merged, base, experts, data, tmp_path, monkeypatch=monkeypatch)
    assert calls == []
    for p, q in zip(again.parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q)


def test_clip_resume_after_interruption(clip_setting, tmp_path, monkeypatch):
    base, experts, merged, data = clip_setting
    _interrupt_then_resume(merged, base, experts, data, tmp_path / "ckpt", monkeypatch, interrupt_at=2, total=2)


@pytest.mark.parametrize("interrupt_at",
                         [2, 3, 4])  # inside the encoder, at the decoder's first block, inside the decoder
def test_t5_resume_across_the_stack_boundary(generator, tmp_path, monkeypatch, interrupt_at):
    base = T5ForConditionalGeneration(t5_config()).eval()
    randomise_t5_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: [seq2seq_batch(generator), seq2seq_batch(generator)] for t in experts}
    _interrupt_then_resume(merged, base, experts, data, tmp_path / "ckpt", monkeypatch, interrupt_at=interrupt_at,
                           total=4)


def test_checkpoint_of_another_run_is_refused(clip_setting, tmp_path, monkeypatch):
    base, experts, merged, data = clip_setting
    with pytest.raises(KeyboardInterrupt):
        _run(merged, base, experts, data, tmp_path, interrupt_at=2, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=r"`checkpoint_dir` .* holds a checkpoint of a different run"):
        _run(merged, base, experts, data, tmp_path, config=FeatCalConfig(lambda_ratio=0.1), monkeypatch=monkeypatch)
    other_data = {t: [{"pixel_values": b["pixel_values"] + 1.0} for b in bs] for t, bs in data.items()}
    with pytest.raises(ValueError, match=r"different run"):
        _run(merged, base, experts, other_data, tmp_path, monkeypatch=monkeypatch)
    other_expert = {**experts, "cars": perturbed(experts["cars"], torch.Generator().manual_seed(5), 0.01)}
    with pytest.raises(ValueError, match=r"different run"):
        _run(merged, base, other_expert, data, tmp_path, monkeypatch=monkeypatch)


def test_a_lora_adapters_config_is_part_of_the_run(clip_setting, tmp_path, monkeypatch):
    """Changing an adapter expert's `lora_alpha` (its weights untouched) changes the expert: the checkpoint
    of the run before is refused, not continued with another expert."""
    import json

    from peft import LoraConfig, get_peft_model

    base, experts, merged, data = clip_setting
    torch.manual_seed(0)
    get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=8, init_lora_weights=False,
                                                   target_modules=["q_proj", "fc1"])).save_pretrained(tmp_path / "a")
    with_adapter = {**experts, "cars": str(tmp_path / "a")}
    with pytest.raises(KeyboardInterrupt):
        _run(merged, base, with_adapter, data, tmp_path / "ckpt", interrupt_at=2, monkeypatch=monkeypatch)
    config_path = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 16
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"holds a checkpoint of a different run .*adapter_config\.json"):
        _run(merged, base, with_adapter, data, tmp_path / "ckpt", monkeypatch=monkeypatch)
    config["lora_alpha"] = 8  # the same expert again: the run continues
    config_path.write_text(json.dumps(config))
    _, _, calls = _run(merged, base, with_adapter, data, tmp_path / "ckpt", monkeypatch=monkeypatch)
    assert len(calls) == 1
