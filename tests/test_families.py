"""Model families (`hf_featcal.families`): detection, the labels the CLI prints per
family, and a `hf-featcal --help` that loads no heavy library."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import (
    BertConfig,
    BertModel,
    CLIPVisionModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTModel,
)

from hf_featcal import cli
from hf_featcal.families import detect_family, family_names, get_family, image_family_names
from testing_utils import tiny_vision_config

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
    decoder = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)
    found = {name: detect_family(model) for name, model in [
        ("clip", CLIPVisionModel(tiny_vision_config())), ("t5", t5), ("open_clip CLIP", tiny_clip()),
        ("open_clip tower", tiny_tower()), ("bert", bert),
        ("roberta", RobertaConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)),
        ("vit", ViTModel(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                   image_size=8, patch_size=4))),
        *((name, config(**decoder)) for name, config in [("llama", LlamaConfig), ("mistral", MistralConfig),
                                                         ("qwen2", Qwen2Config), ("qwen3", Qwen3Config)]),
        ("gpt2", GPT2Config(n_layer=1, n_embd=8, n_head=2))]}
    assert {name: f.name if f else None for name, f in found.items()} == {
        "clip": "clip", "t5": "flan_t5", "open_clip CLIP": "open_clip", "open_clip tower": "open_clip", "bert": "bert",
        "roberta": "bert", "vit": "vit", "llama": "causal_lm", "mistral": "causal_lm", "qwen2": "causal_lm",
        "qwen3": "causal_lm", "gpt2": None}
    # every architecture with a layer map has a family (the command line and recipes take it)
    from hf_featcal.architectures import supported_model_types

    configs = {"bert": BertConfig, "roberta": RobertaConfig, "vit": ViTConfig, "llama": LlamaConfig,
               "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "t5": T5Config}
    for model_type in supported_model_types():
        if model_type in configs:
            assert detect_family(configs[model_type]()) is not None, model_type
    assert family_names() == ("bert", "causal_lm", "clip", "flan_t5", "open_clip", "vit")
    assert image_family_names() == ("clip", "open_clip")
    # the score label each family prints above its evaluation table, with its unit or direction
    assert [get_family(n).score_heading() for n in family_names()] == [
        "no built-in evaluation", "held-out perplexity (lower is better)", "zero-shot top-1 accuracy (%)",
        "GLUE headline score (%)", "zero-shot top-1 accuracy (%)", "no built-in evaluation"]
    assert [n for n in family_names() if not get_family(n).evaluates] == ["bert", "vit"]
    with pytest.raises(KeyError, match="unknown model family 'gpt2'.*'bert', 'causal_lm', 'clip'"):
        get_family("gpt2")


def test_cli_says_what_to_do_with_a_model_without_a_layer_map(tmp_path, capsys):
    """`hf-featcal calibrate` / `evaluate` on a model no family takes (GPT-2 has no layer map): exit 2, the
    families named, and the two ways on (the inferred map from Python, or a layer map of its own)."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
    model.save_pretrained(tmp_path / "gpt2")
    argv = {"evaluate": ["evaluate", "--model", str(tmp_path / "gpt2"), "--task", "cola"],
            "calibrate": ["calibrate", "--model", str(tmp_path / "gpt2"), "--expert", f"a={tmp_path / 'gpt2'}",
                          "--data", "a=org/data", "--output-dir", str(tmp_path / "out")]}
    for command, args in argv.items():
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"hf-featcal {command}: error: --model: model_type 'gpt2' (GPT2LMHeadModel) has no "
                              "layer map"), err
        assert "families: bert, causal_lm, clip, flan_t5, open_clip, vit" in err
        assert "FeatCalCalibrator(..., allow_inferred_layer_map=True)" in err and "docs/architectures.md" in err
    assert not (tmp_path / "out").exists()
    recipe = tmp_path / "recipe.yaml"  # a recipe naming a family the base is not of says the same
    recipe.write_text(f"model_family: causal_lm\nbase: {tmp_path / 'gpt2'}\nexperts: {{a: {tmp_path / 'gpt2'}}}\n"
                      "merge: {method: task_arithmetic}\ncalibration: {default: {dataset: org/data}}\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    assert cli.main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "base has model_type 'gpt2', which is not a 'causal_lm' model: model_type 'gpt2' (GPT2LMHeadModel) has no " \
           "layer map" in err and "allow_inferred_layer_map=True" in err


def test_merge_copies_the_base_processing_for_a_model_without_a_family(tmp_path, capsys):
    """`hf-featcal merge` of a model no family takes still writes what the base was saved with (its tokenizer),
    as mergekit does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{str(i): 2 + i for i in range(10)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>")
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=len(vocab), n_positions=16)
    for name in ("base", "a", "b"):
        GPT2LMHeadModel(config).save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / "base")
    assert cli.main(["merge", "--base", str(tmp_path / "base"), f"--expert=a={tmp_path / 'a'}",
                     f"--expert=b={tmp_path / 'b'}", "--output-dir", str(tmp_path / "merged")]) == 0
    assert "(with the base's tokenizer)" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(tmp_path / "merged")("3 4")["input_ids"] == [vocab["3"], vocab["4"]]


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


def _family_branches(path, names):
    """Lines of `path` that compare with a family's name or look a family up by a literal name."""
    import ast

    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_family":
            operands = node.args
        else:
            continue
        for operand in operands:
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_code_outside_architectures_and_families_branches_on_a_family_name():
    """docs/architectures.md: only `architectures/` and `families/` know a family by its name; the rest
    asks the registry or the layer map. A planted branch is found (so the check can fail)."""
    import hf_featcal

    root = os.path.dirname(hf_featcal.__file__)
    names = set(family_names())
    found = []
    for folder, _, files in os.walk(root):
        relative = os.path.relpath(folder, root).split(os.sep)[0]
        if relative in ("architectures", "families"):
            continue
        found += [line for name in files if name.endswith(".py")
                  for line in _family_branches(os.path.join(folder, name), names)]
    assert found == []


def test_the_family_branch_check_finds_a_planted_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(family, model):\n    if family.name == 'open_clip':\n        return get_family('clip')\n")
    assert _family_branches(str(planted), set(family_names())) == [f"{planted}:2", f"{planted}:3"]


def test_vit_merges_and_calibrates_from_the_command_line(tmp_path, capsys):
    """`model_family` vit: `merge` keeps the base's image processor, `calibrate` processes the images with it
    and saves the weights the Python API computes on the same images."""
    import datasets
    import numpy as np
    import torch
    from PIL import Image
    from transformers import ViTImageProcessor

    from hf_featcal import FeatCalCalibrator, FeatCalConfig
    from hf_featcal.data import sample_examples

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       image_size=8, patch_size=4)
    base = ViTModel(config).eval()
    base.save_pretrained(tmp_path / "base")
    processor = ViTImageProcessor(size={"height": 8, "width": 8})
    processor.save_pretrained(tmp_path / "base")
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    experts = {}
    for task in ("a", "b"):
        expert = ViTModel(config).eval()
        expert.load_state_dict({k: v + 0.05 * torch.randn(v.shape, generator=generator)
                                for k, v in base.state_dict().items()})
        expert.save_pretrained(tmp_path / task)
        experts[task] = str(tmp_path / task)
        images = [Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)) for _ in range(12)]
        datasets.Dataset.from_dict({"img": images}).save_to_disk(str(tmp_path / f"data_{task}"))
    flags = [f"--expert={t}={path}" for t, path in experts.items()]
    assert cli.main(["merge", "--base", str(tmp_path / "base"), *flags, "--output-dir", str(tmp_path / "merged")]) == 0
    assert "(with the base's image processor)" in capsys.readouterr().out
    assert ViTImageProcessor.from_pretrained(tmp_path / "merged").to_dict() == processor.to_dict()
    assert cli.main(["calibrate", "--model", str(tmp_path / "merged"), "--base", str(tmp_path / "base"), *flags,
                     "--data-default", str(tmp_path / "data_{task}"), "--num-examples", "8", "--batch-size", "4",
                     "--output-dir", str(tmp_path / "out"), "--quiet"]) == 0
    assert ViTImageProcessor.from_pretrained(tmp_path / "out").to_dict() == processor.to_dict()

    calibration = {t: sample_examples(datasets.load_from_disk(str(tmp_path / f"data_{t}")), 8, seed=42)
                   for t in experts}
    reference = FeatCalCalibrator(ViTModel.from_pretrained(tmp_path / "merged"), str(tmp_path / "base"), experts,
                                  calibration, FeatCalConfig(batch_size=4, num_samples_per_task=None),
                                  processing_class=processor, show_progress=False).calibrate()
    saved = ViTModel.from_pretrained(tmp_path / "out").state_dict()  # a save stores ViT under its legacy names
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)
