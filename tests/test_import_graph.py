"""scripts/import_graph.py finds import circles however the import is written (top level, inside a
function, under TYPE_CHECKING, through a package's lazy loader), upward imports across its floors and
modules on no floor, and fails on any; the package itself has none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_floor(import_graph, monkeypatch):
    """Every module on one floor: the synthetic packages below test circles alone."""
    monkeypatch.setattr(import_graph, "FLOORS", [("all", ("*",))])


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for name, text in {"__init__.py": "", **files}.items():
        path = src / "hf_featcal" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


def test_function_level_and_type_checking_imports_close_a_circle(import_graph, one_floor, tmp_path, capsys):
    src = _package(tmp_path, {
        "low.py": "def f():\n    from .high import g\n    return g\n",
        "high.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import mid\n",
        "mid.py": "from .low import f\n",
        "leaf.py": "import os\n",
    })
    assert import_graph.main(["--src", str(src)]) == 1
    out = capsys.readouterr().out
    assert "circle of 3: hf_featcal.high, hf_featcal.low, hf_featcal.mid" in out
    assert "leaf" not in out.split("largest files")[0]


def test_a_lazy_package_loader_depends_on_the_modules_it_names(import_graph, one_floor, tmp_path, capsys):
    src = _package(tmp_path, {
        "maps/__init__.py": (
            "import importlib\n_MODULES = ('one',)\n"
            "def __getattr__(name):\n"
            "    if name == 'extra':\n        return importlib.import_module('.extra', __name__)\n"
            "    for module in _MODULES:\n        importlib.import_module(f'.{module}', __name__)\n"
        ),
        "maps/one.py": "from ..io import read\n",
        "maps/extra.py": "",
        "io.py": "def read():\n    from .maps import thing\n",
    })
    assert import_graph.main(["--src", str(src)]) == 1
    assert "circle of 3: hf_featcal.io, hf_featcal.maps, hf_featcal.maps.one" in capsys.readouterr().out


def test_no_circle_passes_and_a_new_circle_fails(import_graph, one_floor, tmp_path):
    src = _package(tmp_path, {"a.py": "from .b import x\n", "b.py": "x = 1\n"})
    assert import_graph.main(["--src", str(src)]) == 0
    (src / "hf_featcal" / "b.py").write_text("def f():\n    from .a import x\n")
    assert import_graph.main(["--src", str(src)]) == 1


def test_an_import_from_a_lower_floor_to_a_higher_one_fails(import_graph, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(import_graph, "FLOORS", [("low", ("", "core", "core.*")), ("high", ("runner",))])
    src = _package(tmp_path,
                   {"core/__init__.py": "", "core/solve.py": "x = 1\n", "runner.py": "from .core.solve import x\n"})
    assert import_graph.main(["--src", str(src)]) == 0  # downward only
    (src / "hf_featcal" / "core" / "solve.py").write_text("def f():\n    from ..runner import y\n")
    assert import_graph.main(["--src", str(src)]) == 1
    out = capsys.readouterr().out
    assert "upward: hf_featcal.core.solve (floor 0) -> hf_featcal.runner (floor 1)" in out


def test_a_module_on_no_floor_fails(import_graph, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(import_graph, "FLOORS", [("all", ("", "a"))])
    src = _package(tmp_path, {"a.py": "x = 1\n"})
    assert import_graph.main(["--src", str(src)]) == 0
    (src / "hf_featcal" / "b.py").write_text("y = 2\n")
    assert import_graph.main(["--src", str(src)]) == 1
    assert "on no floor: hf_featcal.b" in capsys.readouterr().out


def test_the_package_has_no_circle_and_no_upward_import(import_graph, capsys):
    assert import_graph.main([]) == 0, capsys.readouterr().out
    assert "0 circle(s), 0 upward import(s)" in capsys.readouterr().out


def test_architecture_knowledge_imports_neither_capture_hooks_nor_restore(import_graph):
    """The `nn.MultiheadAttention` patch is architecture knowledge and lives in architectures/mha.py:
    no module of architectures/ imports the capture hooks (hooks.py) or the restore code (restore.py)."""
    names = import_graph.module_names(ROOT / "src")
    reached = {
        name: import_graph.imports_of(name, path, set(names)) & {"hf_featcal.hooks", "hf_featcal.restore"}
        for name, path in names.items()
        if name.startswith("hf_featcal.architectures")
    }
    assert "hf_featcal.architectures.mha" in reached
    assert {name: found for name, found in reached.items() if found} == {}
