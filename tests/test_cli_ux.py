"""What every command shares and what a user sees: --device / --quiet on every command with one default,
exit status 2 for a usage error and 1 for a run that failed, RegMean refused with where to run it, class
names from the dataset's ClassLabel, the demo's table marking a task that fell, and output folders that
do not land in the working directory."""

from __future__ import annotations

import json
import re

import pytest

import test_cli
from hf_featcal import cli
from hf_featcal.cli._common import DEVICE_HELP
from hf_featcal.cli.demo import accuracy_table
from test_cli import TASKS, _recipe, _write

world = test_cli.world  # the tiny local world of models and datasets (a module-scoped fixture)
COMMANDS = ["merge", "calibrate", "evaluate", "run", "demo", "compare"]  # push computes nothing: --quiet only


def _experts(world):
    return [a for t in TASKS for a in ("--expert", f"{t}={world / 'experts' / t}")]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_device_and_quiet_with_one_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one option per line
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    parser = subparsers.choices[command]
    options = {action.dest: action for action in parser._actions}
    assert options["quiet"].default is False and options["device"].default is None
    assert options["device"].help.startswith(DEVICE_HELP)


def test_push_takes_quiet_but_no_device():
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    options = {action.dest for action in subparsers.choices["push"]._actions}
    assert "quiet" in options and "device" not in options


def test_a_usage_error_exits_2_and_a_failed_run_exits_1(world, tmp_path, capsys):
    # usage: a flag's value the command line cannot take (nothing loaded)
    assert cli.main(["merge", "--base", str(world / "base"), *_experts(world), "--scaling-factor", "x",
                     "--output-dir", str(tmp_path / "a")]) == 2
    capsys.readouterr()
    # a failed run: the files are there, but a model in them cannot be read
    broken = tmp_path / "broken-expert"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    code = cli.main(["merge", "--base", str(world / "base"), "--expert", f"zorbs={broken}",
                     "--output-dir", str(tmp_path / "b"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.splitlines()[-1].startswith("hf-featcal merge: error: ValueError: ") and "Traceback" not in err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_merge_and_run_say_where_a_method_that_needs_data_runs(method, world, tmp_path, capsys):
    code = cli.main(["merge", "--base", str(world / "base"), *_experts(world), "--method", method,
                     "--output-dir", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"'{method}' needs calibration data" in err and "hf-featcal compare RECIPE" in err
    recipe = _recipe(world, output_dir=str(tmp_path / "r"))
    recipe["merge"] = {"method": method}
    assert cli.main(["run", _write(world / f"needs-data-{method}.yaml", recipe), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"merge.method: '{method}' needs calibration data" in err and "compare: merges:" in err


def test_merge_shows_its_bar_unless_quiet(world, tmp_path, capsys):
    for quiet, out in ((False, "loud"), (True, "quiet")):
        assert cli.main(["merge", "--base", str(world / "base"), *_experts(world), "--output-dir",
                         str(tmp_path / out), *(["--quiet"] if quiet else [])]) == 0
        err = capsys.readouterr().err
        assert ("Merging (task_arithmetic)" in err) is not quiet, err


def test_evaluate_takes_class_names_from_the_datasets_class_label(world, tmp_path, capsys):
    scores = {}
    for name, extra in (("given", [f"--class-names=zorbs={','.join(TASKS['zorbs'])}"]), ("read", [])):
        out = tmp_path / f"{name}.json"
        assert cli.main(["evaluate", "--model", str(world / "base"), "--task", "zorbs",
                         "--data", f"zorbs={world / 'data' / 'zorbs'}", *extra, "--output-json", str(out),
                         "--quiet", "--device", "cpu"]) == 0, capsys.readouterr().err
        scores[name] = json.loads(out.read_text())["scores"]
    assert scores["read"] == scores["given"]


def test_the_demo_table_marks_a_task_that_fell():
    lines = accuracy_table(["topic", "language"], {
        "experts (own task)": {"topic": 0.912, "language": 0.925},
        "Task Arithmetic (0.3)": {"topic": 0.847, "language": 0.908},
        "Task Arithmetic + FeatCal": {"topic": 0.855, "language": 0.861},
    }, "Task Arithmetic (0.3)")
    featcal = next(line for line in lines if line.startswith("| Task Arithmetic + FeatCal"))
    assert re.search(r"85\.5\s+\|", featcal) and "86.1 ↓" in featcal
    assert all("↓" not in line for line in lines if line.startswith(("| experts", "| Task Arithmetic (0.3)")))
    assert lines[-1] == "\n↓: below Task Arithmetic (0.3) on that task"
    same = accuracy_table(["a"], {"m": {"a": 0.5}, "m + x": {"a": 0.5}}, "m")
    assert not any("↓" in line for line in same)


def test_compare_demo_writes_under_outputs_not_the_working_directory(tmp_path, monkeypatch, capsys):
    from hf_featcal.cli import _common

    monkeypatch.chdir(tmp_path)
    folder = _common.default_output_dir("compare")
    assert re.fullmatch(r"outputs/compare-\d{8}-\d{6}", folder)
    assert cli.main(["compare", "--demo", "--fast", "--cache-dir", str(tmp_path / "cache"), "--merges",
                     "task_arithmetic", "--post-merging", "none", "--quiet"]) == 0
    written = list((tmp_path / "outputs").iterdir())
    assert len(written) == 1 and re.fullmatch(r"compare-\d{8}-\d{6}", written[0].name)
    assert (written[0] / "comparison.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "outputs"]
    assert f"outputs/{written[0].name}/" in capsys.readouterr().out
