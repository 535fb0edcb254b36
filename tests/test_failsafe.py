"""Fail-safe runs: a failure anywhere leaves the caller's model bit-identical, a resume from
`checkpoint_dir` gives the uninterrupted result, a checkpoint is never unpickled and is tied to the
exact contents of the run's weights and data, and the checkpoint commit has no unsafe window."""

from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import torch

import hf_featcal.pipeline.solve as solve_stage
from hf_featcal import FeatCalCalibrator, FeatCalConfig, checkpointing
from hf_featcal.checkpointing import STATE_NAME


# ============================================================================ helpers
def damage_outside_the_blocks(model) -> None:
    """What a failure late in calibrate() may leave behind in a CLIP vision model: parameters and a
    buffer outside the blocks (embeddings, final norm, position ids) changed, and the dtype changed."""
    with torch.no_grad():
        model.embeddings.patch_embedding.weight.zero_()
        model.post_layernorm.bias.add_(1.0)
        model.embeddings.position_ids.fill_(0)
    model.half()


def _model_state(model: torch.nn.Module) -> dict:
    """Every parameter and buffer: value, dtype, device (and the tensor objects the caller holds)."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    return {name: (t.detach().clone(), t.dtype, t.device, id(t)) for name, t in tensors.items()}


def _assert_bit_identical(model: torch.nn.Module, before: dict, context: str = "") -> None:
    now = _model_state(model)
    assert now.keys() == before.keys(), context
    for name, (value, dtype, device, ident) in before.items():
        got, got_dtype, got_device, got_ident = now[name]
        assert (got_dtype, got_device, got_ident) == (dtype, device, ident), f"{context}: {name}"
        assert torch.equal(got, value), f"{context}: {name}"


def _assert_same_result(model, calibrator, expected_model, expected_calibrator, context: str = "") -> None:
    got, want = model.state_dict(), expected_model.state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{context}: {name}"
    assert calibrator.report.to_dict() == expected_calibrator.report.to_dict(), context
    assert len(calibrator.solve_log) == len(expected_calibrator.solve_log), context


class _Fault:
    """Raise `error` at the `at`-th call of the wrapped functions (counting only while armed)."""

    def __init__(self, at: int | None, error: type[BaseException]) -> None:
        self.at, self.error, self.calls = at, error, 0

    def wrap(self, monkeypatch, owner, attr: str) -> None:
        original = getattr(owner, attr)

        def faulty(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                raise self.error(f"fault injected in {attr} (call {self.at})")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, faulty)


# where faults are injected: name → (owner of the function, given the calibrator; attribute)
_POINTS = {
    "block forward": (lambda c: c.layer_map, "run_block"),
    "expert block load": (lambda c: c.experts["dtd"], "block"),
    "linear solve": (lambda c: solve_stage, "solve_linear_weights"),
    "layer-norm solve": (lambda c: solve_stage, "solve_layer_norm"),
    "parameter write": (lambda c: c.parameters, "write"),
    "checkpoint file write": (lambda c: checkpointing, "save_file"),
    "checkpoint rename": (lambda c: checkpointing.os, "replace"),
    "checkpoint commit": (lambda c: checkpointing, "commit_state"),
    "old streams cleanup": (lambda c: checkpointing.os, "remove"),
}


def _calibrator(model, setting, checkpoint_dir=None, config=None) -> FeatCalCalibrator:
    base, experts, _, data = setting
    return FeatCalCalibrator(model, base, experts, data, config or FeatCalConfig(), show_progress=False,
                             checkpoint_dir=checkpoint_dir)


def _count_calls(setting, point: str, tmp_path) -> int:
    model = copy.deepcopy(setting[2])
    calibrator = _calibrator(model, setting, tmp_path / f"count-{point}")
    fault = _Fault(None, RuntimeError)
    with pytest.MonkeyPatch.context() as patch:
        owner, attr = _POINTS[point]
        fault.wrap(patch, owner(calibrator), attr)
        calibrator.calibrate()
    return fault.calls


# ============================================================================ fault injection
def test_faults_anywhere_leave_the_model_unchanged_and_resume_gives_the_uninterrupted_result(clip_setting, tmp_path):
    expected_model = copy.deepcopy(clip_setting[2])
    expected = _calibrator(expected_model, clip_setting)
    expected.calibrate()
    cases = 0
    for point in _POINTS:
        total = _count_calls(clip_setting, point, tmp_path)
        assert total > 0, point
        for position, at in enumerate(sorted({1, (total + 1) // 2, total})):
            error = KeyboardInterrupt if position % 2 else RuntimeError
            context = f"{point}, call {at} of {total}, {error.__name__}"
            folder = tmp_path / f"{point.replace(' ', '-')}-{at}"
            model = copy.deepcopy(clip_setting[2])
            before = _model_state(model)
            calibrator = _calibrator(model, clip_setting, folder)
            with pytest.MonkeyPatch.context() as patch:
                owner, attr = _POINTS[point]
                _Fault(at, error).wrap(patch, owner(calibrator), attr)
                with pytest.raises(error, match="fault injected"):
                    calibrator.calibrate()
            _assert_bit_identical(model, before, context)
            assert calibrator.report is None, context
            if folder.exists():  # no half-written files
                assert not [n for n in os.listdir(folder) if n.endswith(".tmp")], context

            resumed = _calibrator(model, clip_setting, folder)
            resumed.calibrate()
            _assert_same_result(model, resumed, expected_model, expected, context)
            cases += 1
    assert cases >= 2 * len(_POINTS)


# ============================================================================ point 5: commit window
def test_interrupt_between_the_new_files_and_the_state_commit_keeps_the_last_block(clip_setting, tmp_path, monkeypatch):
    expected_model = copy.deepcopy(clip_setting[2])
    expected = _calibrator(expected_model, clip_setting)
    expected.calibrate()

    folder = tmp_path / "ckpt"
    model = copy.deepcopy(clip_setting[2])
    original_replace = os.replace

    def replace(src, dst):  # the files of block 2 are in place; the state marker is not yet replaced
        if os.path.basename(dst) == STATE_NAME and json.load(open(src))["finished_blocks"] == 2:
            raise KeyboardInterrupt
        return original_replace(src, dst)

    monkeypatch.setattr(checkpointing.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _calibrator(model, clip_setting, folder).calibrate()
    monkeypatch.setattr(checkpointing.os, "replace", original_replace)
    assert json.load(open(folder / STATE_NAME))["finished_blocks"] == 1

    resumed = _calibrator(model, clip_setting, folder)
    blocks = []
    original_block = resumed._calibrate_block
    monkeypatch.setattr(
        resumed, "_calibrate_block", lambda plan, *a: blocks.append(plan.block_index) or original_block(plan, *a)
    )
    resumed.calibrate()
    assert blocks == [1]  # block 1 was kept, only block 2 (index 1) was redone
    _assert_same_result(model, resumed, expected_model, expected)


# ============================================================================ point 3: nothing unpickled
class _Payload:
    """Unpickling this creates the marker file: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _interrupted_checkpoint(setting, folder, monkeypatch) -> None:
    calibrator = _calibrator(copy.deepcopy(setting[2]), setting, folder)
    original = calibrator._calibrate_block
    calls = []

    def interrupt_second(plan, *args):
        calls.append(plan)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(plan, *args)

    monkeypatch.setattr(calibrator, "_calibrate_block", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        calibrator.calibrate()


def test_a_tampered_checkpoint_is_never_unpickled(clip_setting, tmp_path, monkeypatch):
    marker = str(tmp_path / "payload-ran")
    payload = {"student": _Payload(marker)}

    # 1. a checkpoint in the old layout: state.json without a format and pickled streams
    old = tmp_path / "old"
    _interrupted_checkpoint(clip_setting, old, monkeypatch)
    state = json.load(open(old / STATE_NAME))
    json.dump({"fingerprint": state["fingerprint"], "finished_blocks": 1}, open(old / STATE_NAME, "w"))
    torch.save(payload, old / "streams-rank0.pt")
    with pytest.raises(Exception) as refused:
        _calibrator(copy.deepcopy(clip_setting[2]), clip_setting, old).calibrate()
    assert not os.path.exists(marker), "the pickle payload was executed"
    assert refused.type is ValueError and "written by an older hf_featcal" in str(refused.value)

    # 2. the streams file of a current checkpoint replaced by a pickle (as torch.save and plain pickle write it)
    for writer in (lambda p: torch.save(payload, p), lambda p: pickle.dump(payload, open(p, "wb"))):
        folder = tmp_path / f"new-{len(os.listdir(tmp_path))}"
        _interrupted_checkpoint(clip_setting, folder, monkeypatch)
        (streams,) = [n for n in os.listdir(folder) if n.startswith("streams-")]
        writer(str(folder / streams))
        model = copy.deepcopy(clip_setting[2])
        before = _model_state(model)
        with pytest.raises(Exception) as refused:
            _calibrator(model, clip_setting, folder).calibrate()
        assert not os.path.exists(marker), "the pickle payload was executed"
        assert refused.type is ValueError and f"is damaged ({streams}" in str(refused.value)
        _assert_bit_identical(model, before)


def test_checkpoint_files_are_safetensors_and_json(clip_setting, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _interrupted_checkpoint(clip_setting, folder, monkeypatch)
    names = sorted(os.listdir(folder))
    assert names == ["block-00001.safetensors", STATE_NAME, "streams-rank0-block00001.safetensors"]
    from safetensors import safe_open

    with safe_open(str(folder / names[2]), framework="pt") as handle:
        structure = json.loads(handle.metadata()["structure"])
    assert set(structure["$dict"]) == {"student", "expert", "given", "report", "solve_log", "guard_log",
                                       "heldout_student", "heldout_expert", "heldout_given"}


# ============================================================================ point 4: exact fingerprint
def _swap_two_entries(tensor: torch.Tensor) -> None:
    """Swap two entries that a sum / strided-sample summary cannot tell apart (same multiset, unsampled)."""
    flat = tensor.view(-1)
    with torch.no_grad():
        a, b = flat[1].clone(), flat[2].clone()
        assert a != b
        flat[1], flat[2] = b, a


def test_resume_refuses_an_expert_with_two_entries_swapped(clip_setting, tmp_path, monkeypatch):
    base, experts, merged, data = clip_setting
    folder = tmp_path / "ckpt"
    _interrupted_checkpoint(clip_setting, folder, monkeypatch)
    swapped = {**experts, "cars": copy.deepcopy(experts["cars"])}
    _swap_two_entries(swapped["cars"].encoder.layers[1].mlp.fc1.weight)
    with pytest.raises(ValueError, match=r"`checkpoint_dir` .* holds a checkpoint of a different run"):
        FeatCalCalibrator(copy.deepcopy(merged), base, swapped, data, show_progress=False,
                          checkpoint_dir=folder).calibrate()

    # the same for an expert read from a folder, with the file's size and modification time kept
    from safetensors.torch import load_file, save_file

    for task, expert in experts.items():
        expert.save_pretrained(tmp_path / task)
    on_disk = {t: str(tmp_path / t) for t in experts}
    folder = tmp_path / "ckpt-files"
    _interrupted_checkpoint((base, on_disk, merged, data), folder, monkeypatch)
    path = tmp_path / "cars" / "model.safetensors"
    stat = os.stat(path)
    tensors = load_file(str(path))
    (key,) = [k for k in tensors if k.endswith("encoder.layers.1.mlp.fc1.weight")]
    _swap_two_entries(tensors[key])
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size
    with pytest.raises(ValueError, match=r"holds a checkpoint of a different run"):
        FeatCalCalibrator(copy.deepcopy(merged), base, on_disk, data, show_progress=False,
                          checkpoint_dir=folder).calibrate()


def test_fingerprint_hashes_every_byte():
    t = torch.arange(1000, dtype=torch.float32)
    digests = {checkpointing.fingerprint([("t", t)])}
    for i in range(0, 1000, 97):  # any single entry, by one ulp
        u = t.clone()
        u[i] = torch.nextafter(u[i], torch.tensor(float("inf")))
        digests.add(checkpointing.fingerprint([("t", u)]))
    assert len(digests) == 1 + len(range(0, 1000, 97))
    # dtype and shape are part of the digest even with the same bytes
    assert checkpointing.fingerprint([("t", t.view(10, 100))]) != checkpointing.fingerprint([("t", t)])
    assert checkpointing.fingerprint([("t", t.view(torch.int32))]) != checkpointing.fingerprint([("t", t)])
    bf16 = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert checkpointing.fingerprint([("t", bf16)]) == checkpointing.fingerprint([("t", bf16.clone())])


# ============================================================================ point 1: every failure restores
def test_an_unusable_device_is_refused_up_front(clip_setting):
    base, experts, merged, data = clip_setting
    with pytest.raises(ValueError, match=r"`device`: 'meta' holds no values"):
        FeatCalCalibrator(merged, base, experts, data, device="meta")
    with pytest.raises(ValueError, match=r"`device`: 'warp-drive' is not a torch device"):
        FeatCalCalibrator(merged, base, experts, data, device="warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"`device`: 'cuda' is not usable on this machine"):
            FeatCalCalibrator(merged, base, experts, data, device="cuda")
    with pytest.raises(ValueError, match=r"`device`: 'cuda:97' is not usable on this machine"):
        FeatCalCalibrator(merged, base, experts, data, device="cuda:97")


def test_a_failed_move_to_the_compute_device_restores_values_and_placement(clip_setting):
    base, experts, merged, data = clip_setting
    model = copy.deepcopy(merged)
    before = _model_state(model)
    calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
    calibrator.device = torch.device("meta")  # a device that takes the model but cannot run it
    with pytest.raises(Exception):  # noqa: B017 - whichever error torch raises for kernels on meta
        calibrator.calibrate()
    _assert_bit_identical(model, before)  # also the parameters outside the blocks, which went to meta too


def test_a_failure_restores_tensors_outside_the_blocks(clip_setting, monkeypatch):
    base, experts, merged, data = clip_setting
    model = copy.deepcopy(merged)
    before = _model_state(model)
    calibrator = FeatCalCalibrator(model, base, experts, data, show_progress=False)
    original = calibrator._sweep

    def sweep_then_fail():
        original()
        damage_outside_the_blocks(model)
        raise RuntimeError("late failure")

    monkeypatch.setattr(calibrator, "_sweep", sweep_then_fail)
    with pytest.raises(RuntimeError, match="late failure"):
        calibrator.calibrate()
    _assert_bit_identical(model, before)


# ============================================================================ point 2: stale shard index
def _folder_with_stale_index(tmp_path, name, expert_a, expert_b, keep_shards: bool):
    """B saved sharded into the folder, then A saved there as one file with B's index left behind
    (save_pretrained removes B's shards but not the index; a copied-in file keeps both)."""
    from transformers import CLIPVisionModel

    folder = tmp_path / name
    expert_b.save_pretrained(folder, max_shard_size="10KB")
    assert (folder / "model.safetensors.index.json").exists()
    if keep_shards:
        expert_a.save_pretrained(tmp_path / f"{name}-single")
        (folder / "model.safetensors").write_bytes((tmp_path / f"{name}-single" / "model.safetensors").read_bytes())
        assert len([n for n in os.listdir(folder) if n.startswith("model-0")]) > 1
    else:
        expert_a.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").exists()
    loaded = CLIPVisionModel.from_pretrained(folder).eval()  # what transformers reads there: A
    for key, value in expert_a.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    return folder, loaded


@pytest.mark.parametrize("keep_shards", [False, True])
def test_a_stale_shard_index_loses_to_the_single_file_as_in_transformers(clip_setting, tmp_path, keep_shards):
    from hf_featcal.merging import task_arithmetic
    from hf_featcal.model_io import safetensors_files
    from testing_utils import assert_same_up_to_rounding
    from testing_utils import task_arithmetic as reference_task_arithmetic

    base, experts, merged, data = clip_setting
    expert_b = copy.deepcopy(experts["dtd"])
    folder, loaded = _folder_with_stale_index(tmp_path, "cars", experts["cars"], expert_b, keep_shards)
    assert set(safetensors_files(str(folder)).values()) == {str(folder / "model.safetensors")}

    # merging reads A
    merged_from_folder = task_arithmetic(base, {"cars": str(folder), "dtd": experts["dtd"]})
    reference = reference_task_arithmetic(base, {"cars": loaded, "dtd": experts["dtd"]})
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(merged_from_folder.state_dict()[key], value, rtol=0, atol=1e-7, msg=key)

    # calibration reads A: as with the model from_pretrained gives, and unlike with B
    def calibrated(cars):
        model = copy.deepcopy(merged)
        FeatCalCalibrator(model, base, {"cars": cars, "dtd": experts["dtd"]}, data, show_progress=False).calibrate()
        return model.state_dict()

    from_folder, from_loaded, with_b = calibrated(str(folder)), calibrated(loaded), calibrated(expert_b)
    assert_same_up_to_rounding(from_folder, from_loaded)
    assert max(float((from_folder[k] - with_b[k]).abs().max()) for k in with_b) > 1e-3


def test_config_transformers_weights_decides_first(clip_setting, tmp_path):
    """transformers reads the file config.json names in `transformers_weights` before any other."""
    from transformers import CLIPVisionModel

    from hf_featcal.model_io import safetensors_files

    base, experts, merged, data = clip_setting
    folder, _ = _folder_with_stale_index(tmp_path, "cars", experts["cars"], experts["dtd"], keep_shards=True)
    config = json.load(open(folder / "config.json"))
    json.dump({**config, "transformers_weights": "model.safetensors.index.json"}, open(folder / "config.json", "w"))
    loaded = CLIPVisionModel.from_pretrained(folder)
    assert torch.equal(loaded.state_dict()["encoder.layers.0.mlp.fc1.weight"],
                       experts["dtd"].state_dict()["encoder.layers.0.mlp.fc1.weight"])
    assert str(folder / "model.safetensors") not in set(safetensors_files(str(folder)).values())
