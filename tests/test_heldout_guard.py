"""The held-out split and guard (`FeatCalConfig.heldout_fraction`, `guard`, `guard_gammas`;
`hf_featcal.pipeline.guard`) and the drift report's held-out columns, against independent computations:
the documented split rule, a calibration on the calibration batches alone, the blend written from an
unguarded run's weights in float64, and full-model forwards of the blended and calibrated models on
the held-out examples."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hf_featcal import FeatCalCalibrator, FeatCalConfig, FeatCalWarning
from hf_featcal.pipeline import guard as guard_stage
from hf_featcal.pipeline.guard import choose_gamma, split_heldout
from hf_featcal.post_merging import get_step
from test_drift_sample import _calibrated
from test_resume import _run
from testing_utils import as_float64, build_clip_setting

BATCH_SIZES = (4, 4, 4, 4)  # 16 examples per task: a quarter held out is one whole batch


def _setting(generator, sizes=BATCH_SIZES):
    return build_clip_setting(generator, sizes)


def _documented_split(sizes, fraction: float, seed: int) -> dict[int, int]:
    """The rule the config field states: round(fraction × examples), at least one, as whole batches in
    the order of `torch.randperm` seeded with `seed`, the last one cut to its first examples; batch →
    how many of its first examples are held out."""
    wanted = max(1, round(fraction * sum(sizes)))
    order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    held, count = {}, 0
    for b in order:
        if count == wanted:
            break
        held[b] = min(sizes[b], wanted - count)
        count += held[b]
    return held


def _parts(batches, held):
    """The held-out and calibration pixel tensors of one task's `batches` under the split `held`."""
    out = [b["pixel_values"][: held[i]] for i, b in enumerate(batches) if i in held]
    kept = [b["pixel_values"][held.get(i, 0):] for i, b in enumerate(batches)
            if held.get(i, 0) < len(b["pixel_values"])]
    return out, kept


def _block0(model):
    return model.encoder.layers[0]


def _hidden(model, pixels, index):
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[index]


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(("changes", "message"), [
    ({"guard": "no_rise"}, r"FeatCalConfig.guard='no_rise' needs held-out examples: set heldout_fraction > 0"),
    ({"guard": "minimax", "heldout_fraction": 0.0}, r"guard='minimax' needs held-out examples"),
    ({"guard": "sometimes", "heldout_fraction": 0.25}, r"FeatCalConfig.guard must be one of \['none', 'no_rise'"),
    ({"heldout_fraction": 1.0}, r"FeatCalConfig.heldout_fraction must be in \[0, 1\), got 1.0"),
    ({"heldout_fraction": -0.1}, r"FeatCalConfig.heldout_fraction must be in \[0, 1\)"),
    ({"heldout_fraction": math.nan}, r"FeatCalConfig.heldout_fraction must be a finite real number"),
    ({"heldout_fraction": "0.25"}, r"FeatCalConfig.heldout_fraction must be a finite real number"),
    ({"guard_gammas": [0.5, 1.0]}, r"FeatCalConfig.guard_gammas must be a list of increasing numbers in \[0, 1\] "
                                   r"starting at 0"),
    ({"guard_gammas": [0.0, 0.75, 0.5]}, r"FeatCalConfig.guard_gammas must be"),
    ({"guard_gammas": [0.0, 1.5]}, r"FeatCalConfig.guard_gammas must be"),
    ({"guard_gammas": [0.0, True]}, r"FeatCalConfig.guard_gammas must be"),
    ({"guard_gammas": []}, r"FeatCalConfig.guard_gammas must be"),
])
def test_bad_guard_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        FeatCalConfig(**changes)


def test_guard_settings_validate_on_assignment_and_round_trip(tmp_path):
    config = FeatCalConfig(heldout_fraction=0.25, guard="minimax", guard_gammas=(0, 0.5, 1))
    assert config.guard_gammas == [0, 0.5, 1]  # a tuple is kept as the list JSON gives back
    with pytest.raises(ValueError, match="FeatCalConfig.heldout_fraction must be in"):
        config.heldout_fraction = 2.0
    assert config.heldout_fraction == 0.25
    with pytest.raises(ValueError, match="needs held-out examples"):
        config.heldout_fraction = 0.0  # the guard would be left without examples
    assert FeatCalConfig.from_pretrained(config.save_pretrained(tmp_path)) == config


def test_too_few_batches_to_hold_out_is_refused_before_any_work(generator):
    base, experts, merged, data = _setting(generator, (1,))  # one example per task: none would be left
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    with pytest.raises(ValueError, match=r"FeatCalConfig.heldout_fraction=0.25: task 'cars' has 1 calibration "
                                         r"example\(s\); holding out 1 would leave none"):
        FeatCalCalibrator(merged, base, experts, data, FeatCalConfig(heldout_fraction=0.25), show_progress=False)
    assert all(torch.equal(v, state[k]) for k, v in merged.state_dict().items())


# ------------------------------------------------------------------------------------ split
@pytest.mark.parametrize(("sizes", "fraction", "seed"), [((4, 4, 4, 4), 0.25, 42), ((5, 3, 4, 2, 6), 0.4, 7),
                                                         ((5, 3, 4, 2, 6), 0.01, 0), ((32, 32), 0.25, 0)])
def test_split_is_the_documented_draw_disjoint_and_deterministic(generator, sizes, fraction, seed):
    # every example numbered: its first pixel holds its index
    pixels = torch.randn(sum(sizes), 3, 8, 8, generator=generator)
    pixels[:, 0, 0, 0] = torch.arange(sum(sizes), dtype=torch.float32)
    data = {"a": [{"pixel_values": chunk} for chunk in pixels.split(list(sizes))]}
    calibration, heldout = split_heldout(data, fraction, seed, "pixel_values")
    want_out, want_kept = _parts(data["a"], _documented_split(sizes, fraction, seed))
    got_out, got_kept = [b["pixel_values"] for b in heldout["a"]], [b["pixel_values"] for b in calibration["a"]]
    assert len(got_out) == len(want_out) and all(torch.equal(g, w) for g, w in zip(got_out, want_out, strict=True))
    assert len(got_kept) == len(want_kept) and all(torch.equal(g, w) for g, w in zip(got_kept, want_kept, strict=True))
    out_ids = {int(i) for x in got_out for i in x[:, 0, 0, 0]}
    kept_ids = {int(i) for x in got_kept for i in x[:, 0, 0, 0]}
    assert out_ids.isdisjoint(kept_ids) and out_ids | kept_ids == set(range(sum(sizes)))  # every example once
    assert len(out_ids) == max(1, round(fraction * sum(sizes)))
    again = split_heldout(data, fraction, seed, "pixel_values")
    assert all(torch.equal(g, b["pixel_values"]) for g, b in zip(got_out, again[1]["a"], strict=True))


def test_heldout_examples_never_reach_the_statistics(generator):
    """Without a guard, the held-out run's weights are those of a run given only the calibration
    batches; the calibrator's two parts are the documented split of the given batches."""
    setting = _setting(generator, (4, 3, 5, 4))
    base, experts, merged, data = setting
    config = FeatCalConfig(heldout_fraction=0.4, seed=3)
    model, calibrator = _calibrated(setting, config)
    held = _documented_split((4, 3, 5, 4), 0.4, 3)  # 6 of 16: one batch whole, one cut
    assert any(held[i] < (4, 3, 5, 4)[i] for i in held)
    kept = {t: [{"pixel_values": x} for x in _parts(batches, held)[1]] for t, batches in data.items()}
    reference, _ = _calibrated((base, experts, merged, kept), FeatCalConfig(seed=3))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    assert calibrator.samples_per_task == {t: 10 for t in data}
    assert calibrator.heldout_per_task == {t: 6 for t in data}


# ------------------------------------------------------------------------------------ bit for bit
def test_guard_off_fields_change_nothing(generator):
    """The guard's grid without a guard or held-out share: the default run's weights and report, bit for bit."""
    setting = _setting(generator)
    default, default_run = _calibrated(setting, FeatCalConfig())
    other, other_run = _calibrated(setting, FeatCalConfig(guard="none", heldout_fraction=0.0, guard_gammas=[0, 0.3]))
    assert all(torch.equal(p, q) for p, q in zip(default.parameters(), other.parameters(), strict=True))
    assert default_run.report.to_dict() == other_run.report.to_dict()
    assert "heldout_before" not in default_run.report.to_dict()["tasks"]["cars"]
    assert default_run.guard_log == [] and default_run.report.guard is None


def test_gamma_one_is_the_unguarded_calibration_bit_for_bit(generator, monkeypatch):
    """Every block's choice forced to γ = 1 (the grid's last) after every other γ was written and run:
    the weights are the unguarded run's with the same held-out share, bit for bit."""
    setting = _setting(generator)
    unguarded, plain = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25))
    monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: len(gammas) - 1)
    guarded, run = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, guard="no_rise"))
    assert [entry["gamma"] for entry in run.guard_log] == [1.0, 1.0]
    assert all(torch.equal(p, q) for p, q in zip(guarded.parameters(), unguarded.parameters(), strict=True))
    assert run.report.tasks == plain.report.tasks  # in-sample and held-out drift alike


# ------------------------------------------------------------------------------------ the guard's numbers
@pytest.mark.parametrize("forced", [None, 2], ids=["its own choice", "forced to γ=0.5"])
def test_written_block_is_the_blend_and_heldout_drift_is_a_full_forward(generator, monkeypatch, forced):
    """Only block 0 calibrated: its written weights are W_merged + γ(W_cal − W_merged) with W_cal from an
    unguarded run (float64 here), and the logged held-out drift at every γ is that of a full-model
    forward of the merged model with block 0 so blended, against the expert's, on the held-out examples."""
    setting = _setting(generator)
    base, experts, merged, data = setting
    layers = [0]
    unguarded, _ = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, layers_to_transform=layers))
    if forced is not None:
        monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: forced)
    guarded, run = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, guard="no_rise",
                                                      layers_to_transform=layers))
    (entry,) = run.guard_log
    gamma = entry["gamma"]
    assert entry["gammas"] == [0.0, 0.25, 0.5, 0.75, 1.0] and entry["block"] == "block 0 of vision_encoder"
    if forced is not None:
        assert gamma == 0.5

    def blended(g: float) -> dict[str, torch.Tensor]:
        m, c = _block0(merged).state_dict(), _block0(unguarded).state_dict()
        return {k: (m[k].double() + g * (c[k].double() - m[k].double())).float() for k in m}

    for name, value in _block0(guarded).state_dict().items():
        torch.testing.assert_close(value, blended(gamma)[name], rtol=1e-6, atol=1e-7)
    untouched = [n for n, _ in merged.named_parameters() if ".layers.0." not in n]
    guarded_params, merged_params = dict(guarded.named_parameters()), dict(merged.named_parameters())
    assert all(torch.equal(guarded_params[n], merged_params[n]) for n in untouched)

    held = _documented_split(BATCH_SIZES, 0.25, FeatCalConfig().seed)
    for task, expert in experts.items():
        pixels = torch.cat(_parts(data[task], held)[0])
        target = _hidden(expert, pixels, 1).double()
        for g, logged in zip(entry["gammas"], entry["heldout_head_drift"][task], strict=True):
            model = copy.deepcopy(merged)
            _block0(model).load_state_dict(blended(g))
            hidden = _hidden(model, pixels, 1).double()
            want = float((hidden - target).norm(dim=-1).sum() / target.norm(dim=-1).sum())
            assert logged == pytest.approx(want, rel=1e-5, abs=1e-9), (task, g)
    if forced is None:  # its own choice obeys its rule on those numbers
        drifts = entry["heldout_head_drift"]
        index = entry["gammas"].index(gamma)
        assert all(d[index] <= d[0] for d in drifts.values())
        assert all(any(d[i] > d[0] for d in drifts.values()) for i in range(index + 1, len(entry["gammas"])))


def test_no_rise_keeps_the_merged_block_where_calibration_would_move_a_perfect_task(generator):
    """One expert *is* the merged model: its held-out drift is 0 at γ = 0 in every block, and the joint
    calibration moves every block for the other task, so γ = 1 raises it: no_rise must keep γ = 0 (the
    merged weights, bit for bit), and never pick a γ at which a task's drift rose."""
    base, experts, merged, data = _setting(generator)
    experts = {"cars": experts["cars"], "copy": copy.deepcopy(merged)}
    data = {"cars": data["cars"], "copy": data["dtd"]}
    model, run = _calibrated((base, experts, merged, data), FeatCalConfig(heldout_fraction=0.25, guard="no_rise"))
    assert len(run.guard_log) == 2
    for entry in run.guard_log:
        drifts = entry["heldout_head_drift"]
        assert drifts["copy"][0] == 0.0 and drifts["copy"][-1] > 0.0  # γ = 1 raises the copy's drift
        index = entry["gammas"].index(entry["gamma"])
        assert all(d[index] <= d[0] for d in drifts.values())
        assert entry["gamma"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), merged.parameters(), strict=True))
    assert all(logged["guard_gamma"] == 0.0 for logged in run.solve_log)
    # unguarded, the same calibration moves the copy's held-out features away from its expert
    with pytest.warns(FeatCalWarning, match=r"task\(s\) \['copy'\]"):
        _, plain = _calibrated((base, experts, merged, data), FeatCalConfig(heldout_fraction=0.25))
    assert plain.report.tasks["copy"]["heldout_head_after"][-1] > 0.0 == plain.report.tasks["copy"][
        "heldout_head_before"][-1]


def test_choose_gamma_rules_on_hand_made_drifts():
    gammas = [0.0, 0.5, 1.0]
    drifts = {"a": [1.0, 0.5, 0.95], "b": [2.0, 1.8, 1.9]}
    assert choose_gamma("no_rise", gammas, drifts) == 2  # the largest γ with no rise
    assert choose_gamma("minimax", gammas, drifts) == 1  # worst ratios 1, 0.9, 0.95
    rising = {"a": [1.0, 0.5, 1.01], "b": [2.0, 1.0, 0.1]}
    assert choose_gamma("no_rise", gammas, rising) == 1
    assert choose_gamma("minimax", gammas, rising) == 1  # worst ratios 1, 0.5, 1.01
    assert choose_gamma("minimax", gammas, {"a": [1.0, 0.5, 0.5]}) == 2  # a tie: the larger γ
    assert choose_gamma("minimax", gammas, {"a": [0.0, 0.1, 0.0], "b": [1.0, 0.2, 0.9]}) == 2  # 0 stays 0: ratio 1
    assert choose_gamma("no_rise", gammas, {"a": [1.0, 1.1, 1.2]}) == 0


# ------------------------------------------------------------------------------------ report and card
def test_report_and_card_show_heldout_drift_beside_in_sample_and_the_gammas(generator):
    """The held-out columns are the mean drift of full-model forwards of the merged and calibrated
    models on the held-out examples, at every block; the summary and the card show them and each γ."""
    setting = _setting(generator)
    base, experts, merged, data = setting
    model, run = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, guard="minimax"))
    report = run.report
    held = _documented_split(BATCH_SIZES, 0.25, FeatCalConfig().seed)
    for task, expert in experts.items():
        pixels = torch.cat(_parts(data[task], held)[0])
        for index in range(2):
            target = _hidden(expert, pixels, index + 1).double()
            tokens = target.shape[0] * target.shape[1]
            for stage, source in (("heldout_before", merged), ("heldout_after", model)):
                want = float((_hidden(source, pixels, index + 1).double() - target).norm(dim=-1).sum() / tokens)
                assert report.tasks[task][stage][index] == pytest.approx(want, rel=1e-5), (task, stage, index)
    assert report.sample["heldout_examples_per_task"] == {"cars": 4, "dtd": 4}
    assert report.guard["mode"] == "minimax" and report.guard["blocks"] == run.guard_log
    assert report.guard_gammas() == {e["block"]: e["gamma"] for e in run.guard_log}
    text = report.summary_markdown()
    assert "held-out before → after" in text and "Held-out guard `minimax`" in text
    for block, gamma in report.guard_gammas().items():
        assert f"{block}: {gamma:g}" in text
    for task in experts:
        st = report.tasks[task]
        assert f"{st['heldout_head_before'][-1]:.2%} → {st['heldout_head_after'][-1]:.2%}" in text
    card = str(run.create_model_card())
    assert "Held-out guard `minimax`" in card and "guard_gammas" in card
    saved = json.loads(json.dumps(report.to_dict()))
    assert type(report).from_dict(saved).to_dict() == report.to_dict()


# ------------------------------------------------------------------------------------ module, resume, step
def test_module_granularity_blends_the_whole_block(generator, monkeypatch):
    """Module granularity with the guard: γ = 1 forced gives the unguarded module-granular weights bit
    for bit, and γ = 0 forced gives the merged model back."""
    setting = _setting(generator)
    unguarded, _ = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, granularity="module"))
    config = FeatCalConfig(heldout_fraction=0.25, guard="no_rise", granularity="module")
    monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: len(gammas) - 1)
    guarded, _ = _calibrated(setting, config)
    assert all(torch.equal(p, q) for p, q in zip(guarded.parameters(), unguarded.parameters(), strict=True))
    monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: 0)
    kept, run = _calibrated(setting, config)
    assert all(torch.equal(p, q) for p, q in zip(kept.parameters(), setting[2].parameters(), strict=True))
    assert [e["gamma"] for e in run.guard_log] == [0.0, 0.0]


def test_resume_keeps_the_heldout_streams_and_gammas(generator, tmp_path, monkeypatch):
    setting = _setting(generator)
    base, experts, merged, data = setting
    config = FeatCalConfig(heldout_fraction=0.25, guard="minimax", guard_gammas=[0, 0.5, 1])
    expected, reference = _calibrated(setting, config)

    with pytest.raises(KeyboardInterrupt):
        _run(merged, base, experts, data, tmp_path, config, interrupt_at=2, monkeypatch=monkeypatch)
    model, calibrator, calls = _run(merged, base, experts, data, tmp_path, config, monkeypatch=monkeypatch)
    assert calls == [(0, 1)]  # block 0 came from the checkpoint
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), expected.parameters(), strict=True))
    assert calibrator.guard_log == reference.guard_log
    assert calibrator.report.to_dict() == reference.report.to_dict()


def test_the_guarded_step_is_featcal_with_its_declared_defaults(generator):
    setting = _setting(generator)
    base, experts, merged, data = setting
    step = get_step("featcal_guarded")
    assert {p.name: p.default for p in step.parameters} == {"heldout_fraction": 0.25, "guard": "no_rise"}
    with pytest.raises(ValueError, match="guard"):
        step.checked_parameters({"guard": "none"})
    result = step.function(merged, base, experts, data, config=FeatCalConfig(), processing_class=None, device="cpu")
    expected, run = _calibrated(setting, FeatCalConfig(heldout_fraction=0.25, guard="no_rise"))
    assert all(torch.equal(p, q) for p, q in zip(result.model.parameters(), expected.parameters(), strict=True))
    assert result.report.guard["blocks"] == run.guard_log
    assert all(torch.equal(p, q) for p, q in zip(merged.parameters(), setting[2].parameters(), strict=True))


def test_two_processes_pick_the_guards_gammas_of_one(tmp_path):
    """Two gloo processes, each with its shard of the calibration and held-out batches: the held-out
    drift is summed over them, so both pick the one-process γs and end with its weights."""
    from test_distributed import _assert_same_model, _run_two_processes

    out = tmp_path / "dist"
    _run_two_processes(out, "clip_guard")
    base, experts, merged, data = as_float64(*build_clip_setting(torch.Generator().manual_seed(0), (4, 3, 5, 2, 4)))
    single = FeatCalCalibrator(merged, base, experts, data,
                               FeatCalConfig(compute_dtype="float64", heldout_fraction=0.4, guard="minimax"),
                               show_progress=False)
    single.calibrate()
    states = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    for state in states:
        assert state.pop("num_processes") == 2
        state.pop("local_batches")
        log = state.pop("guard_log")
        assert [e["gamma"] for e in log] == [e["gamma"] for e in single.guard_log]
        for entry, want in zip(log, single.guard_log, strict=True):
            for task, values in want["heldout_head_drift"].items():
                assert entry["heldout_head_drift"][task] == pytest.approx(values, rel=1e-9)
    _assert_same_model(states, merged.state_dict())


def test_a_recipe_section_takes_the_guard_with_its_heldout_share():
    from hf_featcal.recipes.parse import parse_featcal
    from hf_featcal.recipes.spec import RecipeError

    config = parse_featcal(None, {"guard": "no_rise", "heldout_fraction": 0.25})
    assert (config.guard, config.heldout_fraction) == ("no_rise", 0.25)
    with pytest.raises(RecipeError, match=r"featcal.guard: .*needs held-out examples"):
        parse_featcal(None, {"guard": "no_rise"})


def test_two_stacks_carry_the_heldout_streams(generator, monkeypatch):
    """T5 (encoder and decoder stacks; its batches enter in `calibrate()`): the held-out streams cross
    the stack boundary; γ = 1 forced is the unguarded run bit for bit, γ = 0 forced the merged model."""
    from transformers import T5ForConditionalGeneration

    from test_t5 import randomise_t5_norms, seq2seq_batch, t5_config
    from testing_utils import perturbed, task_arithmetic

    base = T5ForConditionalGeneration(t5_config()).eval()
    randomise_t5_norms(base, generator)
    experts = {t: perturbed(base, generator, 0.05).eval() for t in ("a", "b")}
    merged = task_arithmetic(base, experts)
    data = {t: [seq2seq_batch(generator), seq2seq_batch(generator)] for t in experts}
    setting = (base, experts, merged, data)
    unguarded, plain = _calibrated(setting, FeatCalConfig(heldout_fraction=0.5))
    assert all(len(values) == 4 for values in plain.report.tasks["a"].values())  # every block, held-out too
    config = FeatCalConfig(heldout_fraction=0.5, guard="minimax")
    monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: len(gammas) - 1)
    guarded, run = _calibrated(setting, config)
    assert [e["gamma"] for e in run.guard_log] == [1.0] * 4
    assert all(torch.equal(p, q) for p, q in zip(guarded.parameters(), unguarded.parameters(), strict=True))
    assert run.report.tasks == plain.report.tasks
    monkeypatch.setattr(guard_stage, "choose_gamma", lambda mode, gammas, drifts: 0)
    kept, _ = _calibrated(setting, config)
    assert all(torch.equal(p, q) for p, q in zip(kept.parameters(), merged.parameters(), strict=True))


def test_the_calibrate_command_takes_the_guard(capsys):
    from hf_featcal.cli.app import build_parser, main
    from hf_featcal.cli.calibrate import _featcal_config

    argv = ["calibrate", "--model", "org/merged", "--base", "org/base", "--expert", "a=org/expert-a",
            "--expert", "b=org/expert-b", "--data", "a=org/data", "--data", "b=org/data", "--output-dir", "unused"]
    config = _featcal_config(build_parser().parse_args([*argv, "--heldout-fraction", "0.25", "--guard", "no_rise"]))
    assert (config.heldout_fraction, config.guard) == (0.25, "no_rise")
    plain = _featcal_config(build_parser().parse_args(argv))
    assert (plain.heldout_fraction, plain.guard) == (0.0, "none")  # the paper's run unless asked
    assert main([*argv, "--guard", "always"]) == 2
    assert "guard" in capsys.readouterr().err
    assert main([*argv, "--guard", "no_rise"]) == 2  # a guard without a held-out share, refused before any loading
    assert "heldout_fraction" in capsys.readouterr().err


def test_held_out_batches_are_checked_before_any_work(generator):
    """A held-out batch the merged model cannot take (token ids outside its vocabulary) is refused while
    the calibrator is built, as a calibration batch is: not found by the guard mid-run."""
    from test_real_use import VOCAB, _setting, _text_batch

    base, experts, merged = _setting(generator)
    data = {t: [_text_batch(generator) for _ in range(4)] for t in experts}
    config = FeatCalConfig(heldout_fraction=0.25, guard="no_rise")
    _, heldout = split_heldout(data, config.heldout_fraction, config.seed, "input_ids")
    held = next(i for i, batch in enumerate(data["a"]) if any(batch is h for h in heldout["a"]))
    data["a"][held]["input_ids"][0, 0] = VOCAB + 5
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    with pytest.raises(ValueError, match=r"calibration_data\['a'\].*vocabulary"):
        FeatCalCalibrator(merged, base, experts, data, config, show_progress=False)
    assert all(torch.equal(v, state[k]) for k, v in merged.state_dict().items())
