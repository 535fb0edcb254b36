"""Model families (`hf_featcal.architectures.families`): detection, the labels the CLI prints per
family, and a `hf-featcal --help` that loads no heavy library."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import BertConfig, BertModel, CLIPVisionModel, T5Config, T5ForConditionalGeneration

from conftest import tiny_vision_config
from hf_featcal import cli
from hf_featcal.architectures.families import detect_family, family_names, get_family, image_family_names

_HEAVY = ("torch", "transformers", "datasets", "hf_featcal.calibrator", "hf_featcal.recipes", "hf_featcal.evaluation")


@pytest.mark.parametrize("argv", [["--help"], ["calibrate", "--help"], ["evaluate", "--help"], ["--version"]])
def test_help_loads_no_heavy_library(argv):
    """`hf-featcal --help` (and every command's help) runs without torch, transformers, datasets or the
    calibrator: a fresh interpreter, then a look at what it imported."""
    code = (
        "import sys\n"
        "from hf_featcal import cli\n"
        f"status = cli.main({argv!r})\n"
        f"loaded = [m for m in {_HEAVY!r} if m in sys.modules]\n"
        "print('LOADED', loaded, 'STATUS', status, file=sys.stderr)\n"
    )
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "LOADED [] STATUS 0" in run.stderr, run.stderr[-2000:]
    if argv != ["--version"]:
        assert "usage: hf-featcal" in run.stdout


def test_families_detect_their_models():
    """Each model goes to the family the CLI and recipes treat it as (open_clip by its class, the others
    by `model_type`), and a model of no family to none."""
    open_clip = pytest.importorskip("open_clip")
    from openclip_models import tiny_clip, tiny_tower

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    assert open_clip is not None
    found = {name: detect_family(model) for name, model in [
        ("clip", CLIPVisionModel(tiny_vision_config())), ("t5", t5), ("open_clip CLIP", tiny_clip()),
        ("open_clip tower", tiny_tower()), ("bert", bert)]}
    assert {name: f.name if f else None for name, f in found.items()} == {
        "clip": "clip", "t5": "flan_t5", "open_clip CLIP": "open_clip", "open_clip tower": "open_clip", "bert": None}
    assert family_names() == ("clip", "flan_t5", "open_clip")
    assert image_family_names() == ("clip", "open_clip")
    # the score label each family prints above its evaluation table
    assert [get_family(n).score_label for n in family_names()] == [
        "zero-shot top-1 accuracy", "GLUE headline score", "zero-shot top-1 accuracy"]
    with pytest.raises(KeyError, match="unknown model family 'bert'.*'clip', 'flan_t5', 'open_clip'"):
        get_family("bert")


def test_cli_names_the_supported_families_for_a_model_of_none(tmp_path, capsys):
    """`hf-featcal evaluate` on a model no family claims: exit 2 and a message listing the families."""
    model = BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16))
    model.save_pretrained(tmp_path / "bert")
    assert cli.main(["evaluate", "--model", str(tmp_path / "bert"), "--task", "cola"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'bert' is neither" in err and "supported families: clip, flan_t5, open_clip" in err


@pytest.fixture
def tiny_open_clip_name(tmp_path):
    """A tiny open_clip model config registered under a name (`open_clip.add_model_config`)."""
    pytest.importorskip("open_clip")
    from openclip_models import register_tiny_model_config

    return register_tiny_model_config(tmp_path, "hf-featcal-families-vit")


def test_open_clip_recipe_prints_the_zero_shot_label(generator, tmp_path, tiny_open_clip_name, capsys):
    """`hf-featcal run` on an open_clip recipe labels its table as zero-shot accuracy (it printed "GLUE
    headline score": the CLI chose the label by a family test of its own)."""
    from openclip_models import write_open_clip_recipe_world

    names = {"zorbs": ["red", "green"], "glyphs": ["cat", "dog"]}
    path = write_open_clip_recipe_world(tmp_path, generator, tiny_open_clip_name, names, {"train": 6, "test": 4},
                                        featcal_batch_size=3, num_examples=6)
    assert cli.main(["run", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "zero-shot top-1 accuracy (%), split test" in out
    assert "GLUE" not in out
