"""Helpers that had twins with drifting rules (issue 30, P5) have one home each, with the stricter rule:
`experts.module_device` (skips meta parameters) and `experts.module_dtype`, `architectures.model_type_of`,
`data.IMAGE_COLUMNS`, `model_io.ModelLike`."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertModel, T5Config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hf_featcal"

#: every name a twin was defined under → the one module that may define it (None: nowhere)
HOMES = {
    "module_device": "experts.py",
    "_module_device": None,
    "module_dtype": "experts.py",
    "_module_dtype": None,
    "model_type_of": "architectures/__init__.py",
    "_model_type": None,
    "IMAGE_COLUMNS": "data.py",
    "_IMAGE_COLUMNS": None,
    "ModelLike": "model_io.py",
}


def _module_level_definitions(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_each_former_twin_is_defined_in_one_module():
    found: dict[str, list[str]] = {name: [] for name in HOMES}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _module_level_definitions(path) & set(HOMES):
            found[name].append(path.relative_to(PACKAGE).as_posix())
    assert found == {name: [home] if home else [] for name, home in HOMES.items()}


def test_no_module_looks_up_model_type_inline():
    """The lookup was also written out inline (`getattr(getattr(model, "config", None), "model_type", None)`)."""
    inline = re.compile(r"getattr\(\s*getattr\([^()]*\"config\"[^()]*\)\s*,\s*\"model_type\"")
    places = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if inline.search(path.read_text())
    ]
    assert places == ["architectures/__init__.py"]


def test_module_device_skips_meta_parameters():
    from hf_featcal.evaluation import clip_zeroshot
    from hf_featcal.experts import module_device, module_dtype

    first_on_meta = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, dtype=torch.float64))
    assert module_device(first_on_meta) == torch.device("cpu")
    assert module_device(nn.Linear(2, 2, device="meta")) == torch.device("cpu")  # nothing but meta
    assert module_device(nn.ReLU()) == torch.device("cpu")  # no parameters
    assert module_dtype(nn.Sequential(nn.Embedding(3, 2, dtype=torch.float16), nn.Linear(2, 2))) == torch.float16
    # the CLIP evaluation picks the device and dtype of its inputs with the same rule
    assert clip_zeroshot.module_device is module_device and clip_zeroshot.module_dtype is module_dtype


def test_model_type_of_reads_a_model_or_a_config_and_loads_no_torch():
    from hf_featcal.architectures import model_type_of

    bert = BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    assert model_type_of(bert) == "bert" and model_type_of(T5Config()) == "t5"
    assert model_type_of(nn.Linear(2, 2)) is None and model_type_of(None) is None
    code = (
        "import json, sys\nimport hf_featcal.architectures as architectures\n"
        "architectures.model_type_of\nprint(json.dumps('torch' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) is False
